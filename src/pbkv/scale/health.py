"""A replica's own health, for Ray Serve's `check_health` (`EngineReplica.check_health`). No Ray here.

Ray's controller calls `check_health` every `health_check_period_s`; a call that raises, or that
is not answered within `health_check_timeout_s` (the whole process frozen, e.g. SIGSTOPped),
counts as a failure, and three in a row stop the replica (its calls then fail over: see
`pbkv.scale.failover`). What the process answering cannot tell Ray by itself is whether its
engine still works: the engine runs on its own thread (`pbkv.serve.worker.EngineWorker`), and a
thread that died, or that is stuck in one step, leaves the replica's event loop answering while
every call on it waits forever. `EngineWatch` finds both.

Progress is measured with a probe: a no-op command queued on the engine thread. The thread runs
every queued command before each engine step (and at once when idle), so a probe left unanswered
for `stall_s` means the thread has been inside one step (or blocked) for that long while it had
work: the probe itself is work, so an idle engine always answers.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable


class EngineUnhealthy(RuntimeError):
    """The engine thread is dead, or has not run a queued command for too long."""


class EngineWatch:
    """`check()` raises `EngineUnhealthy` while the engine thread of `worker` (an `EngineWorker`)
    is dead or stalled. Invariants: at most one probe is queued at a time; a probe's age is counted
    by `clock` from when it was queued; once the thread answers it, the next `check()` queues a new
    one, so a stall is reported at the first check more than `stall_s` after the probe went in."""

    def __init__(self, worker, stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.worker, self.stall_s, self.clock = worker, stall_s, clock
        self._probe: Future | None = None
        self._sent = 0.0

    def check(self) -> None:
        if not self._thread_alive():
            raise EngineUnhealthy("the engine thread has died: calls on this replica would never be answered")
        if self._probe is not None and not self._probe.done():
            waited = self.clock() - self._sent
            if waited > self.stall_s:
                raise EngineUnhealthy(f"the engine thread has run no queued command for {waited:.1f} s "
                                      f"(limit {self.stall_s:g} s): it is stuck")
            return
        self._probe, self._sent = self.worker.call(_nothing), self.clock()

    def _thread_alive(self) -> bool:
        # EngineWorker exposes no liveness API; its thread is the one that runs every engine step
        thread = getattr(self.worker, "_thread", None)
        return thread is None or thread.is_alive()


def _nothing() -> None:
    """The probe: answering it is the proof of progress."""
