"""`--record` under kill -9: every finished file is a valid trace holding whole runs only, and
the file being written holds whole runs up to the one the kill cut.

A child process records runs of large calls (each run's lines are far more than one buffer)
without pause; the test kills it with SIGKILL once several files exist, then reads every file.
Before runs were written in one system call, a kill could cut any run (or line) in half; with
one `write` per run only the run being written can be cut (the kernel stops a large write
between pages for a fatal signal: seen once in CI); `read_trace` reports a cut line with the
file and line number, and `pbkv trace repair` keeps the whole runs before it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pbkv.trace import read_trace
from pbkv.trace.repair import repair

CHILD = """
import sys
from pbkv.serve.recorder import TraceRecorder
from pbkv.trace import Call
rec = TraceRecorder(sys.argv[1], "killtest", 16, "tiny", rotate_calls=40)
n = 0
while True:
    calls = [Call(f"w{n}", s, "agent", 16 * 400, 8, list(range(n * 10_000 + s * 400, n * 10_000 + s * 400 + 400)))
             for s in range(8)]
    rec.record(calls)
    n += 1
    if n == 1:
        print("ready", flush=True)
"""


def test_kill_9_leaves_only_whole_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.jsonl"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling another process's progress, bounded by the deadline
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) >= 4
    runs = 0
    for f in files[:-1]:
        trace = read_trace(f)  # raises TraceError on a cut line or a run with a gap
        for calls in trace.workflows().values():
            assert [c.step for c in calls] == list(range(8)) and calls[-1].done
            runs += 1
    assert runs >= 3 * 5  # at least three full files of 5 runs (40 calls each)
    text = files[-1].read_bytes()
    whole = repair(files[-1]).data      # the file being written, up to its last whole run
    assert text.startswith(whole)
    cut = tmp_path / "whole-part.jsonl"
    cut.write_bytes(whole)
    for calls in read_trace(cut).workflows().values():
        assert [c.step for c in calls] == list(range(8)) and calls[-1].done
    assert b'"done":true' not in text[len(whole):]   # what follows is part of one run at most
