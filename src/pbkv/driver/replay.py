"""Run workflows against an engine: closed-loop lanes or open-loop arrivals, honouring tool waits.

- closed loop: `concurrency` lanes; each runs workflows back to back in trace order;
- open loop: each workflow starts at the `t` of its first call, counted from the earliest such
  `t` (its later calls follow their predecessors, as a dependent workflow must). The clock starts
  at the first arrival, not at `t` = 0: a float clock at epoch-sized `t` (1.7e12 ms read as s,
  or ns stamps) cannot resolve a millisecond, and latencies came out quantised or 0.
Inside a workflow, call j+1 is issued when call j has finished plus call j+1's `tool_wait`.
The engine hears of workflow starts and ends (the policy's lifecycle signals) from here.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pbkv.driver.metrics import Recorder
from pbkv.engine.request import Request
from pbkv.trace import Call, arrival_times


class Engine(Protocol):
    now: float

    def at(self, when: float, fn) -> None: ...
    def start_workflow(self, workflow: int, workflow_id: str) -> None: ...
    def end_workflow(self, workflow: int) -> None: ...
    def submit(self, req: Request) -> None: ...
    def run(self) -> None: ...


def check_arrivals(workflows: list[list[Call]], name: str) -> None:
    """An open-loop replay (concurrency None) needs every workflow's arrival time: without
    `t` they would all start at 0, a burst no trace describes."""
    missing = [calls[0].workflow_id for calls in workflows if calls[0].t is None]
    if missing:
        raise ValueError(f"{name}: --concurrency open replays each workflow's arrival time (`t` of its first "
                         f"call), and {len(missing)} of {len(workflows)} workflows have none (first: "
                         f"{missing[0]}); give a number of lanes instead (e.g. --concurrency 16)")


class Replay:
    """Drives `workflows` (each a list of calls in step order) through `engine`."""

    def __init__(self, engine: Engine, workflows: list[list[Call]], concurrency: int | None,
                 recorder: Recorder, progress=None):
        if concurrency is None:
            check_arrivals(workflows, "the replay")
        self.engine = engine
        self.workflows = workflows
        self.concurrency = concurrency
        self.recorder = recorder
        self.progress = progress  # called with the number of finished workflows
        self._queue = deque(range(len(workflows)))
        self._finished = 0

    def run(self) -> Recorder:
        if self.concurrency is None:
            for i, t in enumerate(arrival_times(self.workflows)):
                self.engine.at(t, lambda i=i, t=t: self._start(i, t))
            self._queue.clear()
        else:
            for _ in range(min(self.concurrency, len(self.workflows))):
                self._start(self._queue.popleft(), self.engine.now)
        self.engine.run()
        return self.recorder

    def _start(self, i: int, at: float) -> None:
        """Start workflow `i`, which began at `at` (an open-loop arrival fires when the engine
        next looks at its events, possibly after a long prefill pass: times count from `at`)."""
        calls = self.workflows[i]
        self.recorder.workflow_started(i, calls[0].workflow_id, at)
        self.engine.start_workflow(i, calls[0].workflow_id)
        self._issue(i, 0, at)

    def _issue(self, i: int, step: int, after: float) -> None:
        """Issue call `step` of workflow `i` its tool wait after `after`; the request is stamped
        with that time, its arrival, however late the engine hears of it."""
        call = self.workflows[i][step]
        when = after + (call.tool_wait or 0.0)
        req = Request(call=call, workflow=i, on_done=self._done, arrival=when)
        self.engine.at(when, lambda: self.engine.submit(req))

    def _done(self, req: Request) -> None:
        self.recorder.call_finished(req)
        i, step = req.workflow, req.call.step
        if step + 1 < len(self.workflows[i]):
            self._issue(i, step + 1, req.finished)
            return
        self.engine.end_workflow(i)
        self.recorder.workflow_finished(i, self.engine.now)
        self._finished += 1
        if self.progress:
            self.progress(self._finished)
        if self._queue:
            self._start(self._queue.popleft(), req.finished)
