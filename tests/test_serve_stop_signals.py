"""A server stopped by SIGINT or SIGTERM returns to `pbkv serve`, which has work left: exit 1
after a failed predictor save, with --replicas the replicas' shutdown and hand-off. uvicorn
raised the signal again once it had shut down: SIGTERM (what systemd and Kubernetes send)
killed the process there (exit 143, a failed save unnoticed), and with Ray its handler exited.
A second Ctrl-C (uvicorn's force quit) still runs the app's shutdown steps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from serve_helpers import on_engine, start_server, torch_threads  # noqa: F401

CHILD = """
import os, signal, sys, threading, time
import uvicorn
from pbkv.serve.server import stop_signals_return

async def app(scope, receive, send):
    pass

server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))

def stop():
    while not server.started:   # uvicorn has no started callback
        time.sleep(0.01)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))

threading.Thread(target=stop, daemon=True).start()
with stop_signals_return():
    server.run()
print("returned", flush=True)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the real handlers are back
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_that_stops_the_server_returns_to_the_caller(sig):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", CHILD, sig], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "returned", (r.returncode, r.stdout, r.stderr)


def test_a_forced_quit_still_stops_the_engine_thread_and_saves_the_predictor(torch_threads, tmp_path, caplog):  # noqa: F811
    """uvicorn's force quit (a second Ctrl-C while it waits for connections to close) cuts the
    answers in flight and skips the lifespan's shutdown. Before, that skipped the whole app
    shutdown: the engine thread went on (a daemon inside torch at exit: SIGABRT), nothing learned
    was saved, and the cancelled lifespan was logged as a CancelledError traceback."""
    from pbkv.predict import has_predictor
    folder = tmp_path / "p"
    srv = start_server(predictor_dir=str(folder), learn_steps=20, learn_nice=0)
    worker, learner = srv.state.worker, srv.state.setup.learner
    on_engine(srv, lambda: [learner.add(["plan", "code"], [None, None]) for _ in range(10)])   # ended workflows
    streaming = threading.Event()

    def stream():   # an answer still generating at the quit: the engine thread is busy
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    streaming.set()
        except httpx.HTTPError:
            pass   # cut by the quit
    client = threading.Thread(target=stream)
    client.start()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)   # uvicorn's loggers do not propagate to the root's
    try:
        assert streaming.wait(60)
        srv.server.should_exit = srv.server.force_exit = True   # what uvicorn's handler sets on a second Ctrl-C
        srv.stop()
        client.join(60)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not worker._thread.is_alive() and srv.state.on_shutdown == []   # every shutdown step ran
    assert has_predictor(folder)
    assert "CancelledError" not in caplog.text
