"""`pbkv serve --replicas N` with no engine replica running, on fake handles (no Ray): a completion
is refused at once with 503 `replicas_unavailable` and Retry-After (as /health says then), and a
call already waiting to be placed gives up the same way once no replica has run for
`remote.NO_REPLICA_WAIT_S`; either way it frees its --max-queue slot. A replica back within that
time still serves the waiting call."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pbkv.scale import adapter, remote  # noqa: E402
from pbkv.scale.ingress import ingress_state  # noqa: E402
from pbkv.serve import ServeConfig  # noqa: E402
from pbkv.serve.app import create_app  # noqa: E402
from pbkv.serve.jobs import Done  # noqa: E402
from pbkv.serve.tokenizer import ByteTokenizer  # noqa: E402

INFO = {"replica": "a", "model_name": "tiny", "policy": "pbkv", "tokenizer": ByteTokenizer(512),
        "max_context": 512, "block_size": 16}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


class Stream:
    """A streamed `generate` call: waits until `placed` is set (Ray's router found a replica),
    then answers "ok"; `cancelled` once the ingress gave it up."""

    def __init__(self, placed: asyncio.Event):
        self.placed, self.cancelled, self.events = placed, False, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.events is None:
            await self.placed.wait()
            self.events = [{"replica": "a"}, "ok", Done("stop", 1, 1)]
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        self.cancelled = True


class Handle:
    app_name = "unavailable-app"

    def __init__(self):
        self.placed, self.streams = asyncio.Event(), []

    def options(self, **_):
        return self

    def broadcast(self, method, *args):
        return self

    def results(self, timeout_s=None):   # the ingress's start: every replica's info()
        return [INFO]

    def remote(self, route, job):
        self.streams.append(Stream(self.placed))
        return self.streams[-1]


class Router:
    """This process's Ray router of the app, as `adapter.running_replicas` reads it."""

    def __init__(self, running: int):
        self.app_name, self.curr_replicas = Handle.app_name, ["r"] * running

    def set(self, running: int) -> None:
        self.curr_replicas = ["r"] * running


def _client(state):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")


def _setup(running: int):
    handle, router = Handle(), Router(running)
    adapter.register_router(router)
    state = ingress_state(ServeConfig(model="tiny", max_queue=2), handle, 1)
    return handle, router, state


def _unavailable(answer) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "replicas_unavailable"
    assert answer.headers["retry-after"] == str(remote.RETRY_AFTER_S)


def test_with_no_replica_running_a_completion_is_refused_at_once():
    handle, router, state = _setup(running=0)

    async def main():
        async with _client(state) as http:
            start = time.monotonic()
            for stream in (False, True):
                _unavailable(await http.post("/v1/completions", json=BODY | {"stream": stream}))
                _unavailable(await http.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}))
            assert time.monotonic() - start < 2
            assert state.worker.in_flight == 0 and handle.streams == []   # nothing queued in Ray
    asyncio.run(asyncio.wait_for(main(), 10))   # the old ingress never answered


async def _until(condition, seconds: float = 10.0) -> None:
    """Yield to the event loop until `condition()` holds (a deadline, not a fixed wait)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_a_waiting_call_gives_up_once_no_replica_ran_for_the_wait_and_frees_its_slot(monkeypatch):
    monkeypatch.setattr(remote, "NO_REPLICA_WAIT_S", 0.5)
    monkeypatch.setattr(remote, "POLL_S", 0.05)
    handle, router, state = _setup(running=1)

    async def main():
        async with _client(state) as http:
            calls = [asyncio.ensure_future(http.post("/v1/completions", json=BODY)) for _ in range(2)]
            await _until(lambda: state.worker.in_flight == 2 and len(handle.streams) == 2)   # both wait in Ray's queue
            router.set(0)                                      # every replica lost, none restarting
            start = time.monotonic()
            for answer in await asyncio.gather(*calls):
                _unavailable(answer)
            assert time.monotonic() - start < 3
            assert state.worker.in_flight == 0                 # the --max-queue slots are free again
            assert all(s.cancelled for s in handle.streams)    # taken out of Ray's queue
    asyncio.run(asyncio.wait_for(main(), 10))   # the old ingress never answered


def test_a_replica_back_within_the_wait_serves_the_waiting_call(monkeypatch):
    monkeypatch.setattr(remote, "NO_REPLICA_WAIT_S", 5.0)   # far longer than the outage below, even on a busy machine
    monkeypatch.setattr(remote, "POLL_S", 0.05)
    handle, router, state = _setup(running=1)

    async def main():
        async with _client(state) as http:
            call = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
            await _until(lambda: len(handle.streams) == 1)      # placed in Ray's queue
            router.set(0)
            await asyncio.sleep(0.5)                           # Ray restarts them (polled several times meanwhile)
            router.set(2)
            handle.placed.set()
            answer = await call
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"
    asyncio.run(asyncio.wait_for(main(), 10))   # the old ingress never answered
