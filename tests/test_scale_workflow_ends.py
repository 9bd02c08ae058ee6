"""`pbkv serve --replicas N`, on fake deployment handles (no Ray): a workflow ends on every replica
that ran or runs one of its calls, once its last call in flight finishes (as in one process,
`pbkv.serve.workflows`), and a plain answer's time to first token is when its first piece came
from the replica, not when the ingress handed the held text on."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pbkv.engine.sampling import Sampling  # noqa: E402
from pbkv.scale import adapter, remote  # noqa: E402
from pbkv.scale.ingress import ingress_state  # noqa: E402
from pbkv.serve import ServeConfig, generate  # noqa: E402
from pbkv.serve.app import create_app  # noqa: E402
from pbkv.serve.jobs import Done, Job  # noqa: E402
from pbkv.serve.metrics import parse  # noqa: E402
from pbkv.serve.workflows import Hints  # noqa: E402
from test_scale_failures import FakeHandle, FakeReplica  # noqa: E402
from test_scale_unavailable import Handle as InfoHandle, Router  # noqa: E402


class Call:
    """One streamed `generate` call whose events the test sends (`None`: the stream ends)."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await self.events.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def cancel(self):
        pass


class Replicas(FakeHandle):
    """Replicas `a` and `b`: each `generate` call is a `Call` the test drives; broadcasts reach both."""

    def __init__(self):
        self.a, self.b = FakeReplica("a"), FakeReplica("b")
        super().__init__(self.a, self.b)
        self.calls: list[Call] = []

    def remote(self, route, job):
        self.calls.append(Call())
        return self.calls[-1]


def _submit(worker, handle, done: bool = False, streamed: bool = True):
    job = worker.submit(Job(list(range(40)), Sampling(max_new_tokens=4), Hints("w", "ag", done=done),
                            streamed=streamed))
    return job, worker.tasks[id(job)]


async def _next_call(handle, n: int) -> Call:
    while len(handle.calls) < n:   # the pump task makes its call at its first step
        await asyncio.sleep(0)
    return handle.calls[n - 1]


async def _answered(job, task) -> None:
    """The job's Done came and its pump finished (its bookkeeping included)."""
    while not isinstance(await job.events.get(), Done):
        pass
    await task
    await asyncio.sleep(0)   # the task's done callbacks (the worker's bookkeeping) run on the next turn


def test_a_workflow_done_that_finishes_first_still_ends_the_run_of_a_call_running_elsewhere():
    """The done call (replica a) finished while the workflow's other call ran on b: the ingress
    knew only the replicas whose calls had finished, so b's run stayed open until the idle
    timeout (cut short at shutdown, never recorded). Now b's run ends once that call finishes."""
    handle = Replicas()
    handle.b.workflows.add("w")        # b's run of w (its call below joined it)
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        long, long_task = _submit(worker, handle)
        long_call = await _next_call(handle, 1)
        last, last_task = _submit(worker, handle, done=True)
        last_call = await _next_call(handle, 2)
        long_call.events.put_nowait({"replica": "b"})
        long_call.events.put_nowait("x")
        assert await long.events.get() == "x"          # running on b
        last_call.events.put_nowait({"replica": "a"})
        last_call.events.put_nowait(Done("stop", 40, 1))
        await _answered(last, last_task)
        await asyncio.gather(*worker._background)
        assert handle.b.calls == 0 and "w" in handle.b.workflows   # not while its call runs (as one process)
        long_call.events.put_nowait(Done("stop", 40, 4))
        await _answered(long, long_task)
        await asyncio.gather(*worker._background)
        assert "w" not in handle.b.workflows           # ended once its last call finished
        assert worker.in_flight == 0 and "w" not in worker.visited
    asyncio.run(asyncio.wait_for(main(), 10))


def test_an_ended_workflows_call_placed_after_the_end_still_ends_where_it_ran():
    """POST /v1/workflows/w/end while a call of w waited in Ray's queue: the end reached the
    replicas before the call did, and the run the call then started on b never ended."""
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        job, task = _submit(worker, handle)
        call = await _next_call(handle, 1)
        assert await worker.end_workflow("w") is True   # its call waits in Ray: its run ends after it
        call.events.put_nowait({"replica": "b"})
        handle.b.workflows.add("w")                    # the call starts b's run
        call.events.put_nowait(Done("stop", 40, 4))
        await _answered(job, task)
        await asyncio.gather(*worker._background)
        assert "w" not in handle.b.workflows
    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_workflow_served_call_by_call_on_one_replica_ends_there_without_a_broadcast():
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        for n, done in enumerate([False, False, True], start=1):
            job, task = _submit(worker, handle, done=done)
            call = await _next_call(handle, n)
            call.events.put_nowait({"replica": "a"})
            call.events.put_nowait(Done("stop", 40, 4))
            await _answered(job, task)
        await asyncio.gather(*worker._background)
        assert handle.a.calls == handle.b.calls == 0   # the done call's replica ended its run itself
        assert worker.visited == {}
    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_call_after_the_workflow_done_call_starts_a_new_run_which_stays_open():
    """As in one process: once a workflow_done call arrived, a call with the same id starts a new
    run; that run is not ended when the old one's calls finish."""
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        last, last_task = _submit(worker, handle, done=True)
        last_call = await _next_call(handle, 1)
        new, new_task = _submit(worker, handle)
        new_call = await _next_call(handle, 2)
        for call, replica in [(last_call, "a"), (new_call, "b")]:
            call.events.put_nowait({"replica": replica})
            call.events.put_nowait(Done("stop", 40, 4))
        await _answered(last, last_task)
        await _answered(new, new_task)
        await asyncio.gather(*worker._background)
        assert handle.a.calls == handle.b.calls == 0
        flow = worker.visited["w"]
        assert flow.replicas == {"b"} and flow.in_flight == 0 and not flow.ending
    asyncio.run(asyncio.wait_for(main(), 10))


# ---------------------------------------------------------------------- time to first token

class Clock:
    """`time` as `pbkv.serve.generate` and `pbkv.scale.remote` read it, with a hand-moved perf_counter."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class Timed:
    """A replica's plain answer: its first piece 1 s after the call, its Done 9 s later."""

    def __init__(self, clock: Clock):
        self.clock, self.events = clock, [{"replica": "a"}, "hel", "lo", Done("stop", 2, 2)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        event = self.events.pop(0)
        self.clock.now += 5.0 if isinstance(event, Done) else 0.0 if isinstance(event, dict) else \
            {"hel": 1.0, "lo": 4.0}[event]
        return event

    def cancel(self):
        pass


class TimedHandle(InfoHandle):
    app_name = "ttft-app"

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock

    def remote(self, route, job):
        return Timed(self.clock)


def test_a_plain_answers_time_to_first_token_is_when_its_first_piece_came(monkeypatch):
    """The ingress holds a plain answer's text until its Done (to retry it on another replica);
    the app timed the first token when it got the held text, so TTFT was the whole latency."""
    clock = Clock()
    monkeypatch.setattr(generate, "time", clock)
    monkeypatch.setattr(remote, "time", clock)
    router = Router(1)
    router.app_name = TimedHandle.app_name
    adapter.register_router(router)
    state = ingress_state(ServeConfig(model="tiny"), TimedHandle(clock), 1)

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")
        async with http:
            answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "hello", answer.text
    asyncio.run(main())
    got = parse(state.metrics.exposition().decode())
    assert got["pbkv_request_latency_seconds_sum"] == pytest.approx(10.0)
    assert got["pbkv_time_to_first_token_seconds_sum"] == pytest.approx(1.0)   # was 10.0


async def _old_run_ended_on_a_new_run_on_b(worker, handle):
    """w's old run: a call running on a when the endpoint ended w; then w's new run: a call
    running on b. The old call (not finished) and the new job, each with its task."""
    old, old_task = _submit(worker, handle)
    c1 = await _next_call(handle, 1)
    c1.events.put_nowait({"replica": "a"})
    handle.a.workflows.add("w")
    c1.events.put_nowait("x")
    assert await old.events.get() == "x"
    assert await worker.end_workflow("w") is True
    new, new_task = _submit(worker, handle)
    c2 = await _next_call(handle, 2)
    c2.events.put_nowait({"replica": "b"})
    handle.b.workflows.add("w")
    return (old, old_task, c1), (new, new_task, c2)


def test_a_new_run_of_the_same_id_is_not_ended_by_the_old_runs_last_call():
    """The endpoint ended w while a call of it ran on a; a new call of w then started a new run
    on b (as in one process). When a's call finished, the end broadcast by id cut b's new run."""
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        (old, old_task, c1), (new, new_task, c2) = await _old_run_ended_on_a_new_run_on_b(worker, handle)
        c2.events.put_nowait(Done("stop", 40, 4))
        await _answered(new, new_task)
        c1.events.put_nowait(Done("stop", 40, 4))
        await _answered(old, old_task)
        await asyncio.gather(*worker._background)
        assert "w" in handle.b.workflows    # the new run stays open, waiting for its next call
    asyncio.run(asyncio.wait_for(main(), 10))


def test_an_end_before_the_calls_task_first_runs_still_ends_the_run_it_starts():
    """submit() counted the call but opened its flow only at the task's first step: an end
    handled in between found nothing to mark, and the run the call then started never ended."""
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        job, task = _submit(worker, handle)
        end = worker.end_workflow("w")          # before the call's task ran at all
        call = await _next_call(handle, 1)
        assert await end is True
        call.events.put_nowait({"replica": "b"})
        handle.b.workflows.add("w")
        call.events.put_nowait(Done("stop", 40, 4))
        await _answered(job, task)
        await asyncio.gather(*worker._background)
        assert "w" not in handle.b.workflows
    asyncio.run(asyncio.wait_for(main(), 10))


def test_nor_when_the_new_runs_done_call_is_already_submitted():
    """The new run's workflow_done call left `visited` when it was submitted, so the old run's
    last call saw no newer run and its end, by id, cut the new run on b."""
    handle = Replicas()
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        (old, old_task, c1), (n1, n1_task, c2) = await _old_run_ended_on_a_new_run_on_b(worker, handle)
        c2.events.put_nowait("y")
        assert await n1.events.get() == "y"
        n2, n2_task = _submit(worker, handle, done=True)     # its last call, waiting in Ray
        await _next_call(handle, 3)
        c1.events.put_nowait(Done("stop", 40, 4))            # the old run's last call finishes
        await _answered(old, old_task)
        await asyncio.gather(*worker._background)
        assert "w" in handle.b.workflows
        for t in (n1_task, n2_task):
            t.cancel()
        await asyncio.gather(n1_task, n2_task, return_exceptions=True)
        await asyncio.sleep(0)   # their done callbacks
        assert worker._busy == {} and worker.in_flight == 0   # every flow closed, cancelled ones too
    asyncio.run(asyncio.wait_for(main(), 10))
