"""A replica's `check_health` (`pbkv.scale.health.EngineWatch`): it fails while the engine thread
is dead, or has left a queued command unanswered longer than `stall_s`; never while it is idle or
making progress. Fake workers and an injected clock (no sleeps); one real `EngineWorker` checks the
watch reads the thread it really runs on. No Ray."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from pbkv.scale.health import EngineUnhealthy, EngineWatch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWorker:
    """`EngineWorker.call` queues a command; here the test decides when the thread runs it."""

    def __init__(self):
        self.queued: list[Future] = []
        self._thread = threading.current_thread()   # alive for the test's life

    def call(self, fn) -> Future:
        future = Future()
        self.queued.append(future)
        return future

    def run_queued(self) -> None:
        for f in self.queued:
            f.set_result(None)
        self.queued.clear()


def test_a_worker_that_answers_between_checks_stays_healthy():
    worker, clock = FakeWorker(), Clock()
    watch = EngineWatch(worker, stall_s=8, clock=clock)
    for _ in range(20):
        watch.check()
        clock.now += 5            # each probe is answered within a period shorter than stall_s
        worker.run_queued()
    assert len(worker.queued) == 0


def test_a_probe_unanswered_past_stall_s_fails_every_check_until_answered():
    worker, clock = FakeWorker(), Clock()
    watch = EngineWatch(worker, stall_s=8, clock=clock)
    watch.check()                 # probe queued at t=0; the engine is inside a long step
    for t in (2, 4, 6, 8):
        clock.now = t
        watch.check()             # not yet: a step may take up to stall_s
    assert len(worker.queued) == 1   # one probe at a time
    clock.now = 8.5
    with pytest.raises(EngineUnhealthy, match="no queued command for 8.5 s"):
        watch.check()
    clock.now = 10
    with pytest.raises(EngineUnhealthy):
        watch.check()             # still stuck: Ray needs 3 failures in a row
    worker.run_queued()           # the step ended after all
    watch.check()
    assert len(worker.queued) == 1   # a new probe, from now


def test_a_dead_engine_thread_fails_at_once():
    worker, clock = FakeWorker(), Clock()
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    worker._thread = dead
    with pytest.raises(EngineUnhealthy, match="engine thread has died"):
        EngineWatch(worker, stall_s=8, clock=clock).check()


def test_the_watch_reads_a_real_engine_workers_thread(tmp_path):
    from pbkv.cache import CacheConfig
    from pbkv.scale.replica import start_engine, stop_engine
    from pbkv.serve import ServeConfig
    state, own = start_engine(ServeConfig(model="tiny", online=False, cache=CacheConfig(device_tokens=4096)), "h1")
    watch = EngineWatch(state.worker, stall_s=30)
    watch.check()
    watch._probe.result(timeout=30)   # the idle engine thread answers the probe at once
    watch.check()
    stop_engine(state, own)           # the thread ends, as if it had died
    with pytest.raises(EngineUnhealthy, match="died"):
        watch.check()
