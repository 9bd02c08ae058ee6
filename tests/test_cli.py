"""The `pbkv` command end to end (typer's runner, real files)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.predict.store import live_dir

runner = CliRunner()
DATA = Path(__file__).resolve().parent / "data"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_gen_then_stats_then_bench_on_the_file(tmp_path):
    out = tmp_path / "hover.jsonl.gz"
    r = invoke("gen", "hover", "--workflows", 12, "--seed", 1, "-o", out)
    assert r.exit_code == 0, r.output
    r = invoke("trace", "stats", out, "--json", tmp_path / "s.json")
    assert r.exit_code == 0 and "workflows 12" in r.output
    assert json.loads((tmp_path / "s.json").read_text())["workflows"] == 12
    r = invoke("bench", "--trace", out, "--concurrency", "4", "--device-tokens", 30000,
               "--policies", "kvflow", "--out", tmp_path / "res", "--jobs", 1)
    assert r.exit_code == 0, r.output
    records = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert {r["policy"] for r in records} == {"lru", "kvflow", "oracle"}
    assert (tmp_path / "res" / "hover.png").exists()


def test_bench_generated_workloads_and_table(tmp_path):
    r = invoke("bench", "--workload", "finance,dialogue", "--workflows", 10, "--concurrency", "2,4",
               "--policies", "kvflow", "--out", tmp_path, "--json", tmp_path / "x.json")
    assert r.exit_code == 0, r.output
    assert "finance: 10 workflows" in r.output and "dialogue" in r.output
    records = json.loads((tmp_path / "x.json").read_text())
    # --json is written as well as OUT/bench.json (beside the plots), never instead of it
    assert (tmp_path / "bench.json").read_bytes() == (tmp_path / "x.json").read_bytes()
    # LRU (the reference) and the oracle (the bound) are always added; by default each cell runs
    # in two regimes chosen from the workload's working set (device only, device + host)
    assert len(records) == 24 and [r["policy"] for r in records[:3]] == ["lru", "kvflow", "oracle"]
    assert [r["tiers"] for r in records[:6:3]] == ["device", "device+host"]
    assert records[0]["host_tokens"] == 0 and records[3]["host_tokens"] == 2 * records[3]["device_tokens"]


def test_bench_pbkv_needs_a_predictor_for_a_trace_and_trains_on_train(tmp_path):
    replay, train = tmp_path / "replay.jsonl", tmp_path / "train.jsonl"
    assert invoke("gen", "finance", "--workflows", 6, "--seed", 1, "-o", replay).exit_code == 0
    assert invoke("gen", "finance", "--workflows", 20, "--seed", 2, "-o", train).exit_code == 0
    r = invoke("bench", "--trace", replay, "--policies", "pbkv", "--concurrency", "2", "--out", tmp_path)
    assert r.exit_code == 2 and "needs a trained fused predictor" in r.output and "--train" in r.output
    r = invoke("bench", "--trace", replay, "--train", train, "--policies", "pbkv", "--concurrency", "2",
               "--pressure", "profile", "--out", tmp_path, "--jobs", 1)
    assert r.exit_code == 0, r.output
    # one sample: the verdict says so and how to see the noise
    assert "--samples 3 shows each speedup's range" in " ".join(r.output.split())
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [r["policy"] for r in records] == ["lru", "pbkv", "oracle"]
    assert 0 <= records[1]["trust"] <= 1 and (live_dir(tmp_path / "models" / "train-fused") / "model.safetensors").exists()


def test_gen_from_spec_file(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text("""
name: mine
agents:
  a: {prompt: 600, output: [5, 10]}
  b: {prompt: 700, output: 8}
task: {tokens: 50}
flow:
  start: a
  transitions:
    a: [{to: b}]
    b: [{to: END}]
""")
    r = invoke("gen", "--spec", spec, "--workflows", 3, "-o", tmp_path / "m.jsonl")
    assert r.exit_code == 0, r.output
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 1 + 6


def test_errors_are_clear_and_exit_2(tmp_path):
    r = invoke("bench", "--policies", "lru,nope", "--out", tmp_path)
    assert r.exit_code == 2 and "unknown policy 'nope'" in r.output
    r = invoke("bench", "--profile", "tpu-v9", "--out", tmp_path)
    assert r.exit_code == 2 and "unknown profile 'tpu-v9'" in r.output
    r = invoke("bench", "--concurrency", "8,x", "--out", tmp_path)
    assert r.exit_code == 2 and "--concurrency" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"workflow_id": "w", "step": 0}\n')
    r = invoke("bench", "--trace", bad, "--out", tmp_path)
    assert r.exit_code == 1 and "bad.jsonl:1: field 'agent'" in r.output
    r = invoke("gen", "nosuch", "-o", tmp_path / "x.jsonl")
    assert r.exit_code == 2 and "nosuch" in r.output
    # a trace with a header and no calls: named, not a bare "max() arg is an empty sequence"
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"pbkv_trace": 1, "block_size": 16}\n')
    r = invoke("bench", "--trace", empty, "--policies", "lru", "--out", tmp_path)
    assert r.exit_code == 2 and "empty.jsonl: no calls to replay" in " ".join(r.output.split()), r.output
    replay = tmp_path / "replay.jsonl"
    assert invoke("gen", "finance", "--workflows", 2, "--seed", 1, "-o", replay).exit_code == 0
    r = invoke("bench", "--trace", replay, "--concurrency", "4,open", "--policies", "lru", "--out", tmp_path)
    assert r.exit_code == 2 and "2 of 2 workflows have none" in " ".join(r.output.split()), r.output
    r = invoke("bench", "--trace", replay, "--train", empty, "--policies", "pbkv", "--out", tmp_path)
    assert r.exit_code == 2 and "empty.jsonl: no workflows to train on" in " ".join(r.output.split()), r.output
    for cmd in ("sim", "policy"):
        r = invoke("perf", cmd, "--policy", "pbkv", "--workflows", 3)
        assert r.exit_code == 2 and "pbkv needs a predictor: pass --predictor DIR" in r.output


def test_an_output_path_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch):
    import pbkv.bench.main
    monkeypatch.setattr(pbkv.bench.main, "run", lambda *a: pytest.fail("the run started"))
    monkeypatch.chdir(tmp_path)  # short relative paths: the error box wraps long ones
    Path("f").write_text("")
    Path("d").mkdir()
    cases = [
        (("gen", "hover", "-o", "d"), "d is a folder; give a file name"),
        (("gen", "hover", "-o", "f/x.jsonl"), "f is a file, so f/x.jsonl cannot be written"),
        (("bench", "--policies", "lru", "--out", "f"), "f is a file; give a folder"),
        (("bench", "--policies", "lru", "--json", "d"), "d is a folder; give a file name"),
        (("train", "--trace", "f", "-o", "f"), "f is a file; give a folder"),
        (("trace", "split", "f", "--train-out", "d", "--test-out", "b.jsonl"), "d is a folder; give a file name"),
        (("serve", "--record", "f"), "f is a file; give a folder"),
        (("serve", "--shared-dir", "f"), "f is a file; give a folder"),
    ]
    for args, message in cases:
        r = invoke(*args)
        said = " ".join(r.output.replace("│", " ").split())  # typer's error box, unwrapped
        assert r.exit_code == 2 and message in said, (args, r.output)
    assert invoke("gen", "finance", "--workflows", 1, "-o", "t.jsonl").exit_code == 0
    r = invoke("trace", "stats", "t.jsonl", "--json", "new/stats.json")  # its folder is created
    assert r.exit_code == 0 and json.loads(Path("new/stats.json").read_text())["workflows"] == 1, r.output


def test_an_output_folder_that_cannot_be_written_or_made_is_refused_at_once(tmp_path, monkeypatch):
    # a read-only folder, and one that cannot be created even by root (/proc): exit 2 when the
    # command line is read, before any training or run; the check leaves nothing behind
    import tempfile
    import pbkv.bench.main
    monkeypatch.setattr(pbkv.bench.main, "run", lambda *a: pytest.fail("the run started"))
    monkeypatch.chdir(tmp_path)
    Path("ro").mkdir()
    Path("t.jsonl").write_text("")
    mkdtemp = tempfile.mkdtemp

    def read_only(*a, dir=None, **k):   # chmod does not stop root: a read-only mount is simulated
        if Path(dir).resolve() == (tmp_path / "ro").resolve():
            raise OSError(30, "Read-only file system")
        return mkdtemp(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    cases = [
        (("bench", "--policies", "lru", "--out", "ro"),
         "cannot write ro: cannot create files in ro (Read-only file system)"),
        (("ablate", "--out", "ro/new/deeper"),
         "cannot write ro/new/deeper: cannot create files in ro, so ro/new/deeper cannot be made (Read-only file system)"),
        (("bench", "--policies", "lru", "--json", "ro/b.json"), "cannot write ro/b.json: cannot create files in ro"),
        (("predict-eval", "--train", "t.jsonl", "--test", "t.jsonl", "--json", "ro/o.json"), "cannot write ro/o.json"),
        (("train", "--trace", "t.jsonl", "-o", "ro/p"), "cannot write ro/p: cannot create files in ro"),
        (("gen", "hover", "-o", "ro/t.jsonl"), "cannot write ro/t.jsonl"),
        (("serve", "--record", "ro"), "cannot write ro: cannot create files in ro"),
    ]
    if Path("/proc/self").is_dir():
        cases.append((("ablate", "--out", "/proc/pbkv-no-such-dir"), "cannot write /proc/pbkv-no-such-dir: cannot "
                      "create files in /proc, so /proc/pbkv-no-such-dir cannot be made (No such file or directory)"))
    for args, message in cases:
        r = invoke(*args)
        said = " ".join(r.output.replace("│", " ").split())  # typer's error box, unwrapped
        assert r.exit_code == 2 and message in said, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro", "t.jsonl"] and not any(Path("ro").iterdir())
    r = invoke("trace", "stats", DATA / "chatdev-mini.jsonl", "--json", "new/deeper/s.json")   # a new folder: fine
    assert r.exit_code == 0 and Path("new/deeper/s.json").is_file(), r.output


def test_a_failed_json_write_says_so_once(tmp_path):
    from pbkv.bench.report import write_json
    Path(tmp_path / "f").write_text("")
    with pytest.raises(OSError) as e:
        write_json({}, tmp_path / "f" / "x.json")
    said = str(e.value)
    assert said.count("cannot write") == 1 and said.startswith(f"{tmp_path / 'f' / 'x.json'}: cannot write ("), said


def test_bench_json_refuses_a_non_finite_figure(tmp_path):
    # waits summing to inf gave NaN latencies, written as `NaN` (invalid JSON) with exit 0
    from pbkv.bench.report import write_json
    path = tmp_path / "bench.json"
    with pytest.raises(ValueError) as e:
        write_json([{"workload": "w", "latency": {"p50": 1.0, "mean": float("nan")}}], path, finite=True)
    assert str(e.value) == (f"{path}: not written: [0].latency.mean is nan, not a finite number "
                            f"(JSON has no NaN or infinity)") and not path.exists()
    write_json([{"n": 10**400, "s": "nan", "x": None, "ok": 1.5}], path, finite=True)  # all finite: written
    assert json.loads(path.read_text())[0]["ok"] == 1.5


def test_a_split_that_would_leave_a_part_empty_is_an_error(tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert invoke("gen", "finance", "--workflows", 1, "-o", one).exit_code == 0
    assert invoke("gen", "finance", "--workflows", 2, "-o", two).exit_code == 0
    outs = ["--train-out", tmp_path / "a.jsonl", "--test-out", tmp_path / "b.jsonl"]
    cases = [
        ((one, *outs), 2, "one.jsonl: holds 1 task group(s); a split needs at least two"),
        ((two, *outs, "--test-fraction", 0.01), 2, "all 2 task groups fell in the train part, none in test"),
        ((two, *outs, "--test-fraction", 0), 0, "2 workflows"),  # asked for: every workflow in train
    ]
    for args, code, message in cases:
        r = invoke("trace", "split", *args)
        assert r.exit_code == code and message in " ".join(r.output.split()), r.output
        assert code == 0 or not (tmp_path / "a.jsonl").exists()  # nothing written
    r = invoke("predict-eval", "--trace", one, "--split")
    assert r.exit_code == 2 and "one.jsonl: holds 1 task group(s)" in " ".join(r.output.split()), r.output


def test_trace_stats_on_a_multi_agent_trace_with_heldout():
    f = DATA / "chatdev-mini.jsonl"  # figures counted by hand in test_trace_stats.py
    r = invoke("trace", "stats", f, "--heldout", f)
    assert "H(next agent | current agent): 0.424 bits" in r.output, r.output
    assert "Markov top-1 next-agent accuracy, fit on this trace, tested on heldout: 0.867 over 15 pairs" in r.output
    assert r.exit_code == 0 and "Markov top-1" in r.output and "H(next agent | current agent)" in r.output


def test_help_lists_commands_in_the_order_a_newcomer_uses_them():
    from pbkv.cli import ORDER
    r = invoke("--help")
    assert r.exit_code == 0
    positions = [r.output.index(f" {name} ") for name in ORDER]
    assert positions == sorted(positions)


def test_an_option_shared_by_commands_is_declared_once():
    """Same name, same declaration (flags, help) wherever it appears: `cli/common.py`; -o/--output
    keeps its flags and names what the command writes."""
    import typer.main

    def commands(group, prefix=""):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                yield from commands(cmd, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", cmd
    seen: dict[str, tuple] = {}
    for where, cmd in commands(typer.main.get_command(app)):
        for p in cmd.params:
            # -o/--output says what each command writes there (`common.output_opt`): flags only
            decl = (tuple(p.opts), None if p.opts[-1] == "--output" else getattr(p, "help", None))
            assert seen.setdefault(p.opts[-1], (where, decl))[1] == decl, (where, seen[p.opts[-1]][0], decl)


def test_an_output_that_is_an_input_or_another_output_is_refused_and_the_input_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("gen", "finance", "--workflows", 2, "-o", "t.jsonl").exit_code == 0
    before = Path("t.jsonl").read_bytes()
    Path("link.jsonl").symlink_to("t.jsonl")
    cases = [
        (("trace", "flatten", "t.jsonl", "-o", "t.jsonl"), "-o t.jsonl is the input t.jsonl"),
        (("trace", "flatten", "link.jsonl", "-o", "t.jsonl"), "-o t.jsonl is the input link.jsonl"),
        (("trace", "stats", "t.jsonl", "--json", "./t.jsonl"), "--json t.jsonl is the input t.jsonl"),
        (("trace", "split", "t.jsonl", "--train-out", "a.jsonl", "--test-out", "a.jsonl"),
         "--test-out a.jsonl is also --train-out"),
        (("trace", "export", "t.jsonl", "--to", "agentic-mooncake", "-o", "t.jsonl"), "is the input t.jsonl"),
        (("bench", "--trace", "t.jsonl", "--policies", "lru", "--json", "t.jsonl"), "--json t.jsonl is the input"),
        (("predict-eval", "--trace", "t.jsonl", "--split", "--json", "t.jsonl"), "--json t.jsonl is the input"),
    ]
    for args, message in cases:
        r = invoke(*args)
        assert r.exit_code == 2 and message in " ".join(r.output.split()), (args, r.output)
    assert Path("t.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "t.jsonl"]


def test_bench_reads_a_trace_by_any_name_and_refuses_two_with_one_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trace = (DATA / "chatdev-mini.jsonl").read_bytes()
    for p in ("hover", "a/t.jsonl", "b/t.jsonl"):        # "hover": a trace file, not the built-in workload
        (tmp_path / p).write_bytes(trace)
    r = invoke("bench", "--trace", tmp_path / "hover", "--policies", "lru", "--concurrency", 4, "--jobs", 1,
               "--tiers", "device", "--out", tmp_path / "o")
    assert r.exit_code == 0 and "hover: 3 workflows" in r.output, r.output
    assert json.loads((tmp_path / "o" / "bench.json").read_text())[0]["device_tokens"] < 1000  # chatdev-mini's
    r = invoke("bench", "--trace", tmp_path / "a/t.jsonl", "--trace", tmp_path / "b/t.jsonl", "--policies", "lru",
               "--out", tmp_path / "o")
    assert r.exit_code == 2 and "are both named 't'" in r.output and "rename one of the files" in r.output
    r = invoke("bench", "--workload", "hover,swe,hover", "--policies", "lru", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "hover given twice" in r.output


@pytest.mark.parametrize("args, message", [
    (("--concurrency", ","), "expected positive integers or 'open', comma-separated, got ','"),
    (("--concurrency", "4,4"), "--concurrency: 4 given twice"),
    (("--policies", "lru,kvflow,lru"), "--policies: lru given twice"),
    (("--instances", "2,2"), "--instances: 2 given twice"),
    (("--instances", "99999999999999999999"), "--instances: at most 1024 instances"),
    (("--instances", "2", "--router", "pbkv,round-robin,pbkv"), "--router: pbkv given twice"),
    (("--instances", "2", "--router", "pbkv", "--shared-tokens", "15"),
     "--shared-tokens 15 holds not one block of 16 tokens")])
def test_bench_options_need_distinct_values(tmp_path, args, message):
    r = invoke("bench", "--workload", "finance", "--workflows", 3, "--out", tmp_path,
               *(("--policies", "lru") if "--policies" not in args else ()), *args)
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output


def test_bench_refuses_a_train_file_it_would_not_use(tmp_path):
    trace = DATA / "chatdev-mini.jsonl"
    assert invoke("train", "--trace", trace, "-o", tmp_path / "p", "--epochs", 1).exit_code == 0
    r = invoke("bench", "--trace", trace, "--predictor", tmp_path / "p", "--train", trace, "--policies", "pbkv",
               "--out", tmp_path / "o")
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "--train: nothing would be trained on it; --predictor gives the fused" in said, r.output


def test_bench_train_never_deletes_a_folder_that_holds_no_predictor(tmp_path):
    trace = DATA / "chatdev-mini.jsonl"
    mine = tmp_path / "o" / "models" / "train-fused"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    r = invoke("bench", "--trace", trace, "--train", trace, "--policies", "pbkv", "--out", tmp_path / "o")
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "--train saves its predictor to" in said and "holds other files (notes.txt)" in said, r.output
    assert (mine / "notes.txt").read_text() == "keep me"
