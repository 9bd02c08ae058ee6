"""Command-line inputs that hostile testing found mishandled (bench, ablate, predict-eval, trace,
gen output): each test failed on the code before its fix."""

import json
from pathlib import Path

from typer.testing import CliRunner

from pbkv.cli import app

runner = CliRunner()


def _gen(tmp_path: Path, workload: str = "hover", n: int = 4, name: str | None = None) -> Path:
    out = tmp_path / (name or f"{workload}.jsonl")
    r = runner.invoke(app, ["gen", workload, "-o", str(out), "--workflows", str(n)])
    assert r.exit_code == 0, r.output
    return out


def _fake_predictor(tmp_path: Path) -> Path:
    """The layout of a saved predictor (not loadable: the checks under test come before loading)."""
    pred = tmp_path / "pred"
    (pred / "v000001").mkdir(parents=True)
    (pred / "CURRENT").write_text("v000001")
    (pred / "v000001" / "config.json").write_text('{"format": "pbkv-predictor"}')
    return pred


def _one_line(output: str) -> str:
    return " ".join(output.split())


# ---- an output inside the --predictor folder being read
def test_predict_eval_json_inside_the_predictor_is_refused(tmp_path):
    pred, trace = _fake_predictor(tmp_path), _gen(tmp_path)
    for target in (pred / "v000001" / "config.json", pred / "CURRENT", pred / "new.json"):
        before = target.read_text() if target.exists() else None
        r = runner.invoke(app, ["predict-eval", "--predictor", str(pred), "--trace", str(trace),
                                "--json", str(target)])
        assert r.exit_code == 2, r.output
        assert f"--json {target} is inside the --predictor {pred}" in _one_line(r.output), r.output
        assert (target.read_text() if target.exists() else None) == before


def test_bench_outputs_inside_the_predictor_are_refused(tmp_path):
    pred, trace = _fake_predictor(tmp_path), _gen(tmp_path)
    r = runner.invoke(app, ["bench", "--trace", str(trace), "--predictor", str(pred), "--policies", "lru",
                            "--concurrency", "2", "--out", str(tmp_path / "o"), "--json", str(pred / "config.json")])
    assert r.exit_code == 2, r.output
    assert "is inside the --predictor" in _one_line(r.output), r.output
    r = runner.invoke(app, ["bench", "--trace", str(trace), "--predictor", str(pred), "--policies", "lru",
                            "--concurrency", "2", "--out", str(pred)])
    assert r.exit_code == 2, r.output
    assert "is inside the --predictor" in _one_line(r.output), r.output


# ---- an unusable predictor cache is found before training
def test_a_cache_that_is_a_file_fails_before_training(monkeypatch, tmp_path):
    import pbkv.bench.predictors as predictors

    def trained(*args, **kwargs):
        raise AssertionError("trained before the cache folder was checked")
    monkeypatch.setattr(predictors, "_train_and_save", trained)
    cache = tmp_path / "cachefile"
    cache.write_text("not a folder")
    monkeypatch.setenv("PBKV_CACHE", str(cache))
    r = runner.invoke(app, ["bench", "--workload", "hover", "--workflows", "2", "--policies", "lru,pbkv",
                            "--concurrency", "2", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert f"$PBKV_CACHE={cache}/predictors: {cache} is not a folder" in _one_line(r.output), r.output


# ---- trace split of generated traces
def _split(tmp_path: Path, trace: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r = runner.invoke(app, ["trace", "split", str(trace), "--train-out", str(a), "--test-out", str(b), *extra])
    assert r.exit_code == 0, r.output
    return tuple([json.loads(line) for line in f.read_text().splitlines()[1:]] for f in (a, b))


def _firsts(calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["step"] == 0]


def test_split_keeps_each_generated_task_line_on_one_side(tmp_path):
    train, test = _split(tmp_path, _gen(tmp_path, "dialogue", 200))
    tasks = [{c["context"].split(" | ")[0] for c in _firsts(part)} for part in (train, test)]
    assert tasks[0] and tasks[1] and not tasks[0] & tasks[1], tasks


def test_split_of_a_spec_without_task_variables_splits_by_workflow(tmp_path):
    spec = tmp_path / "plain.yaml"
    spec.write_text("name: plain\nagents:\n  a: {prompt: 100, output: [10, 20]}\ntask: {tokens: [50, 500]}\n"
                    "flow: {start: a}\n")
    trace = tmp_path / "p.jsonl"
    assert runner.invoke(app, ["gen", "--spec", str(spec), "-o", str(trace), "--workflows", "50"]).exit_code == 0
    train, test = _split(tmp_path, trace)
    assert 15 <= len(_firsts(test)) <= 35 and len(_firsts(train)) + len(_firsts(test)) == 50


def test_a_groups_side_does_not_depend_on_the_other_groups():
    """Each task's side comes from a hash of it alone: dropping other tasks moves no workflow (the
    published halves of the real traces stay as they were measured)."""
    from pbkv.trace import Call, Trace, TraceMeta
    from pbkv.trace.transform import split_by_task
    calls = [Call(f"w{i}", 0, "a", 16, 1, [i], context=f"task: t{i % 7}") for i in range(40)]
    _, test = split_by_task(Trace(TraceMeta(), calls), 0.5, seed=3)
    _, fewer = split_by_task(Trace(TraceMeta(), calls[:20]), 0.5, seed=3)
    assert {c.workflow_id for c in fewer.calls} == {c.workflow_id for c in test.calls if int(c.workflow_id[1:]) < 20}


# ---- -o /dev/stdout keeps stdout a valid trace
def test_status_lines_go_to_stderr_when_the_output_is_stdout(tmp_path):
    import subprocess
    import sys
    code = "import sys; from pbkv.cli import app; sys.argv[0] = 'pbkv'; app()"
    trace = _gen(tmp_path, n=1)
    for args in (["gen", "hover", "-o", "/dev/stdout", "--workflows", "1"],
                 ["trace", "flatten", str(trace), "-o", "/dev/stdout"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines and all(json.loads(line) is not None for line in lines), r.stdout[-300:]
        assert "wrote" in r.stderr, r.stderr


def test_an_error_is_one_line_on_stderr_never_in_the_piped_trace(tmp_path):
    """Before: printed on stdout, wrapped at 110 columns: inside a `-o /dev/stdout` stream the
    reader said "not valid JSON" and the real error was never shown."""
    import subprocess
    import sys
    code = "import sys; from pbkv.cli import app; sys.argv[0] = 'pbkv'; app()"
    bad = tmp_path / ("a-long-folder-name-" * 4) / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"workflow_id": "w", "step": 0, "agent": "a", "input_length": 16, "output_length": -3, '
                   '"hash_ids": [1]}\n')
    r = subprocess.run([sys.executable, "-c", code, "trace", "flatten", str(bad), "-o", "/dev/stdout"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) > 110, r.stderr
    assert lines[0].startswith("error: ") and lines[0].endswith("field 'output_length': expected an integer >= 0, got -3")


# ---- --workload empty, or given with --trace
def test_an_empty_workload_list_names_the_option(tmp_path):
    for command in ("bench", "ablate"):
        for value in ("", ","):
            r = runner.invoke(app, [command, "--workload", value, "--workflows", "2", "--concurrency", "2",
                                    "--out", str(tmp_path / "out")])
            assert r.exit_code == 2, r.output
            assert "error: --workload: give at least one workload" in _one_line(r.output), r.output


def test_workload_or_workflows_given_with_trace_are_refused(monkeypatch, tmp_path):
    import pbkv.bench.main
    ran = []
    monkeypatch.setattr(pbkv.bench.main, "run", lambda args, console: ran.append(args))
    trace = _gen(tmp_path, n=2)
    base = ["--trace", str(trace), "--concurrency", "2", "--out", str(tmp_path / "out")]
    for command in ("bench", "ablate"):
        for extra, option in ((["--workload", "swe"], "--workload"), (["--workflows", "1"], "--workflows")):
            r = runner.invoke(app, [command, *base, *extra])
            assert r.exit_code == 2, r.output
            assert f"error: {option}" in _one_line(r.output) and "--trace" in r.output, r.output
        assert runner.invoke(app, [command, *base]).exit_code == 0   # the defaults alone are fine
    assert len(ran) == 2 and [s.name for s in ran[0].sources] == ["hover"]
    r = runner.invoke(app, ["bench", "--workflows", "3", "--concurrency", "2", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0 and [(s.name, s.workflows) for s in ran[-1].sources] == [
        ("hover", 3), ("swe", 3), ("finance", 3), ("dialogue", 3)], r.output


# ---- ablate's advice names only options ablate has
def test_ablate_on_a_trace_without_train_advises_only_train(tmp_path):
    trace = _gen(tmp_path, n=2)
    r = runner.invoke(app, ["ablate", "--trace", str(trace), "--concurrency", "2", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert "pass --train FILE" in _one_line(r.output) and "--predictor" not in r.output, r.output
    r = runner.invoke(app, ["bench", "--trace", str(trace), "--policies", "pbkv", "--concurrency", "2",
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "pass --train FILE (or --predictor DIR)" in _one_line(r.output), r.output


# ---- predict-eval's split error names only options predict-eval has
def test_predict_eval_split_error_does_not_advise_test_fraction(monkeypatch, tmp_path):
    from dataclasses import replace
    import pbkv.predict
    trace = _gen(tmp_path, n=2)
    monkeypatch.setattr(pbkv.predict, "split_by_task", lambda t, f, s: (t, replace(t, calls=[])))
    r = runner.invoke(app, ["predict-eval", "--trace", str(trace), "--split", "--epochs", "1"])
    assert r.exit_code == 2, r.output
    assert "fell in the train part" in _one_line(r.output) and "try another --seed" in _one_line(r.output)
    assert "--test-fraction" not in r.output, r.output


# ---- the predict-eval table is readable at any horizon
def test_predict_table_is_readable_at_large_horizons(monkeypatch):
    import io
    from rich.console import Console
    import pbkv.cli.predict as predict
    for k in (12, 1024):
        metrics = {"calls": 40, "end_acc": 0.9, "ece": 0.05, "us_per_call": 12.0,
                   **{f"top1_k{i}": 0.5 + i / 10_000 for i in range(1, k + 1)}}
        buf = io.StringIO()
        monkeypatch.setattr(predict, "console", Console(file=buf, width=110))
        predict._print_predict_table([("fused", "", metrics), ("markov", "markov_", metrics)])
        text = buf.getvalue()
        assert "…" not in text, text
        assert "top1@k1" in text and f"top1@k{k}" in text and f"{0.5 + k / 10_000:.3f}" in text, text
        assert "0.900" in text and "--json" in text, text


# ---- a test trace whose agents the predictors never saw is noted
def test_predict_eval_notes_agents_the_predictors_never_saw(tmp_path):
    train, test = _gen(tmp_path, "hover", 3), _gen(tmp_path, "swe", 3)
    r = runner.invoke(app, ["predict-eval", "--train", str(train), "--test", str(test), "--epochs", "1"])
    assert r.exit_code == 0, r.output
    agents = [{json.loads(line)["agent"] for line in f.read_text().splitlines()[1:]} for f in (train, test)]
    calls = [json.loads(line)["agent"] for line in test.read_text().splitlines()[1:]]
    unseen = sum(a not in agents[0] for a in calls)
    said = _one_line(r.output)
    assert unseen and f"note: {unseen} of {len(calls)} positions have an agent the predictors never saw" in said, r.output
    assert "code_searcher" in said, r.output
    r = runner.invoke(app, ["predict-eval", "--train", str(train), "--test", str(train), "--epochs", "1"])
    assert r.exit_code == 0 and "never saw" not in r.output, r.output


# ---- trace stats of a trace mixing workloads does not claim one
def test_stats_of_a_mixed_trace_name_every_workload(tmp_path):
    from dataclasses import replace
    from pbkv.trace import read_trace
    from pbkv.trace.stats import format_stats, trace_stats
    hover = read_trace(_gen(tmp_path, "hover", 2))
    swe = [replace(c, workflow_id="s-" + c.workflow_id, workload="swe") for c in hover.calls]
    mixed = replace(hover, calls=hover.calls + swe)
    s = trace_stats(mixed)
    assert s["workload"] is None and s["workloads"] == ["hover", "swe"], s
    assert format_stats(s).splitlines()[0].endswith("(workloads: hover, swe)"), format_stats(s)
    one = trace_stats(hover)
    assert one["workload"] == "hover" and one["workloads"] == ["hover"]
    assert format_stats(one).splitlines()[0] == "## hover"


# ---- --jobs N starts no more workers than there are cells
def test_a_sweep_starts_at_most_one_worker_per_cell(monkeypatch):
    from types import SimpleNamespace
    import pytest
    import pbkv.bench.sweep as sweep
    started = []

    class Pool:
        def __init__(self, max_workers):
            started.append(max_workers)
            raise RuntimeError("stop here")
    monkeypatch.setattr(sweep, "ProcessPoolExecutor", Pool)
    cfg = SimpleNamespace(jobs=16, engine="sim", samples=1)
    with pytest.raises(RuntimeError, match="stop here"):
        sweep.run_sweep(cfg, jobs=[("a",), ("b",)])
    assert started == [2]


# ---- a spec file named *.YAML is a spec file in bench too
def test_an_upper_case_spec_suffix_is_a_spec_file(tmp_path, monkeypatch):
    from pbkv.bench.predictors import PredictorSource, cache_folder
    from pbkv.bench.sweep import source_from_arg
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path / "cache"))
    for name in ("MY.YAML", "my.Yml", "X.JSON"):
        spec = tmp_path / name
        spec.write_text("name: up\nagents:\n  a: {prompt: 100, output: 5}\ntask: {tokens: 50}\nflow: {start: a}\n")
        source = source_from_arg(str(spec), 2, 0)
        assert source.name == spec.stem, source
        assert cache_folder(source, "fused", PredictorSource()).name.startswith(spec.stem + "-")


def test_an_empty_output_path_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch):
    """`--disk-dir "$UNSET"`: a Path option reads "" as ".", so the server's disk tier, a shared
    KV tier or a bench's results went into the current folder without a word."""
    monkeypatch.chdir(tmp_path)
    trace = _gen(tmp_path)
    for args in (["serve", "--disk-dir", ""], ["serve", "--shared-dir", " "], ["serve", "--record", ""],
                 ["bench", "--out", ""], ["trace", "split", str(trace), "--train-out", "", "--test-out", "b.jsonl"],
                 ["train", "--trace", str(trace), "-o", ""]):
        r = runner.invoke(app, args)
        flat = " ".join(r.output.replace("│", " ").split())   # the message may wrap inside rich's box
        assert r.exit_code == 2 and "is empty: give a path" in flat, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace.name]


# ---- status lines print file names as text, not rich markup
def test_status_lines_print_bracketed_file_names_as_given(tmp_path):
    """'out[v2].jsonl' was printed as 'out.jsonl' (rich read '[v2]' as a tag), and a name holding a
    closing tag ('d[/v2].jsonl') crashed with a MarkupError after the file was written."""
    (tmp_path / "d[").mkdir()
    names = [str(tmp_path / n) for n in ("out[v2].jsonl", "d[/v2].jsonl", "t[bold].jsonl", "s[/].jsonl")]
    gen = _gen(tmp_path, name="g[red].jsonl")
    row = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    (tmp_path / "m[x].jsonl").write_text(json.dumps(row) + "\n")
    for args, shown in [
        (["gen", "hover", "--workflows", "2", "-o", names[0]], names[0]),
        (["trace", "flatten", str(gen), "-o", names[1]], names[1]),
        (["trace", "split", str(gen), "--train-out", names[2], "--test-out", names[3]], names[3]),
        (["trace", "repair", str(gen), "-o", names[0]], f"{gen}: not cut"),
        (["trace", "import", "--from", "mooncake", str(tmp_path / "m[x].jsonl"), "-o", names[1]], names[1]),
        (["trace", "export", "--to", "agentic-mooncake", str(gen), "-o", names[2]], names[2]),
    ]:
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and shown in _one_line(r.output), (args, r.output)


def test_bench_prints_a_bracketed_out_folder_as_given(tmp_path):
    """`--out 'res[v2]'` was reported as 'res/bench.json', and 'd[/v2]' crashed with a MarkupError
    after every run and write (exit 1)."""
    (tmp_path / "d[").mkdir()
    for out in (tmp_path / "res[v2]", tmp_path / "d[" / "v2]"):
        r = runner.invoke(app, ["bench", "--workload", "dialogue", "--policies", "lru", "--concurrency", "2",
                                "--workflows", "4", "--jobs", "1", "--out", str(out)])
        assert r.exit_code == 0 and f"results: {out / 'bench.json'}" in _one_line(r.output), r.output
