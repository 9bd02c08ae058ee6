"""Builders for the server tests: the REAL server (uvicorn on a thread, tiny model, free port)."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from pbkv.cache import CacheConfig  # noqa: E402
from pbkv.serve import ServeConfig, ServerThread  # noqa: E402


class FakeClock:
    """The server's workflow clock: moves only when a test says so."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def start_server(**overrides) -> ServerThread:
    cfg = dict(model="tiny", port=0, threads=1, cache=CacheConfig(device_tokens=8192), max_tokens_limit=1024,
               default_max_tokens=8, max_body_bytes=64 * 1024, idle_timeout=60.0)
    cfg.update(overrides)
    return ServerThread(ServeConfig(**cfg)).start()


@pytest.fixture(scope="module")
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the server set one thread (faster for the tiny model)


def on_engine(srv, fn):
    """Run `fn()` on the server's engine thread (it owns the engine, cache, policy, table)."""
    return srv.state.worker.call(fn).result(timeout=60)


def watch_counter(counter) -> threading.Event:
    """An event set the next time the server increments `counter` (an unlabelled
    `prometheus_client.Counter` of `srv.state.metrics`): no polling, no sleeps."""
    event, original = threading.Event(), counter.inc

    def inc(amount=1):
        original(amount)
        event.set()
    counter.inc = inc
    return event
