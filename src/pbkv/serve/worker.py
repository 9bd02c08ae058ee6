"""The engine thread: one FCFS command queue in, per-request asyncio queues out.

The event loop never touches the engine, the cache, the policy or the workflow table: it puts
commands (submit, cancel, end a workflow, run a function) on a thread-safe queue, and the engine
thread answers through `loop.call_soon_threadsafe` into each request's `asyncio.Queue` (or a
`concurrent.futures.Future`). So a slow forward pass never blocks the event loop, and no lock
guards engine state: one thread owns it.

The thread drains every queued command before each engine step (arrival order = submission
order: FCFS), ends idle workflows by the injected clock, then runs one step (one prefill, or one
decode step of every running request: continuous batching). With no work it blocks on the
queue (up to `idle_wait` seconds, so idle workflows still expire without traffic).

Events a request's queue receives: `("text", str)` zero or more times, then exactly one
`("done", reason, info)` with reason "stop" | "length" | "cancelled" | "error".
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from pbkv.serve.backend import CANCELLED, ERROR, Job, ServingEngine
from pbkv.serve.metrics import Metrics
from pbkv.serve.recorder import TraceRecorder
from pbkv.serve.tokenizer import Detokenizer, Tokenizer
from pbkv.serve.workflows import Run, WorkflowTable
from pbkv.trace import Call

log = logging.getLogger("pbkv.serve")
OTHER_AGENT = "other"


class Handle:
    """The event loop's side of one request."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job, self.loop = job, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.req = None  # the engine's Request, set on the engine thread

    def put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass


class EngineWorker:
    def __init__(self, backend: ServingEngine, tokenizer: Tokenizer, table: WorkflowTable, metrics: Metrics,
                 recorder: TraceRecorder | None = None, clock: Callable[[], float] = time.monotonic,
                 max_agents: int = 256, record_context: bool = False, idle_wait: float = 1.0):
        self.backend, self.tok, self.table, self.metrics = backend, tokenizer, table, metrics
        self.recorder, self.clock, self.idle_wait = recorder, clock, idle_wait
        self.max_agents, self.record_context = max_agents, record_context
        self.origin = clock()
        self.agents: set[str] = set()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="pbkv-engine", daemon=True)
        self._count_lock = threading.Lock()
        self.in_flight = 0   # jobs submitted and not yet done (for the queue limit and /metrics)

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, key: str | None, agent: str | None, done: bool,
               stops: list[str]) -> Handle:
        handle = Handle(job, asyncio.get_running_loop())
        self._count(+1)
        self._q.put(("submit", handle, key, agent, done, stops))
        return handle

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self.in_flight += delta

    def cancel(self, handle: Handle) -> None:
        self._q.put(("cancel", handle))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine thread (after every command queued before); its result."""
        fut: Future = Future()
        self._q.put(("call", fn, fut))
        return fut

    def expire_idle(self) -> Future:
        """End idle workflows now (the thread also does it about every second); how many ended."""
        return self.call(lambda: self._reap(self.clock()))

    def end_workflow(self, key: str) -> Future:
        """`POST /v1/workflows/{key}/end`: resolves to False for an unknown (or ended) id."""
        return self.call(lambda: self._end_key(key))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or runs, end every workflow (the policy hears it), close the recorder."""
        if self._thread.is_alive():
            self._q.put(("stop",))
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        next_reap = self.clock()
        while True:
            try:
                cmd = self._q.get(timeout=self.idle_wait) if not self.backend.busy() else self._q.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    return self._shutdown()
                self._command(cmd)
                try:
                    cmd = self._q.get_nowait()
                except queue.Empty:
                    cmd = None
            now = self.clock()
            if now >= next_reap:
                next_reap = now + min(1.0, self.table.idle_timeout / 4)
                self._reap(now)
            if self.backend.busy():
                try:
                    self.backend.step()
                except Exception as e:  # noqa: BLE001 - answer the clients, keep serving
                    log.exception("engine step failed")
                    self.backend.fail_all(f"the engine failed: {type(e).__name__}: {e}")

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        try:
            if kind == "submit":
                self._submit(*cmd[1:])
            elif kind == "cancel":
                handle = cmd[1]
                if handle.req is not None:  # a request that already ended is left alone
                    self.backend.cancel(handle.req)
            elif kind == "call":
                fn, fut = cmd[1], cmd[2]
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        except Exception as e:  # noqa: BLE001 - one bad command must not stop the engine thread
            log.exception("command %s failed", kind)
            if kind == "submit" and cmd[1].req is None:  # it never reached the engine
                self._count(-1)
                cmd[1].put(("done", ERROR, {"error": f"{type(e).__name__}: {e}"}))

    def _agent(self, agent: str | None) -> str | None:
        """Agent names are client strings: at most `max_agents` distinct ones, the rest 'other'."""
        if agent is None or agent in self.agents:
            return agent
        if len(self.agents) >= self.max_agents:
            return OTHER_AGENT
        self.agents.add(agent)
        return agent

    def _submit(self, handle: Handle, key: str | None, agent: str | None, done: bool, stops: list[str]) -> None:
        job, now = handle.job, self.clock()
        run, step, new = self.table.begin(key, self._agent(agent), now, done, job.context)
        if new:
            self.metrics.workflows_started.inc()
            self.backend.start_workflow(run.wf, run.record_id)
        job.workflow, job.record_id, job.step, job.agent = run.wf, run.record_id, step, run.agents[step]
        detok = Detokenizer(self.tok, stops)
        arrival = now

        def on_token(j: Job, token: int) -> bool:
            text = detok.push(token)
            if text:
                handle.put(("text", text))
            return detok.stopped

        def on_done(j: Job, reason: str, req) -> None:
            tail = detok.finish()
            if tail and reason != ERROR:
                handle.put(("text", tail))
            info = {"prompt_tokens": len(j.prompt_ids), "completion_tokens": len(j.tokens), "error": j.error}
            if req is not None:
                info.update(cached=req.device_hit + req.host_hit + req.disk_hit)
                self._account(req, j)
                self._record(run, j, req.call.hash_ids, arrival)
            self._count(-1)
            handle.put(("done", reason, info))
            if self.table.finish(run, self.clock()):
                self._end_run(run)

        job.on_token, job.on_done = on_token, on_done
        try:
            handle.req = self.backend.submit(job)
        except Exception:
            if self.table.finish(run, self.clock()):
                self._end_run(run)
            raise

    def _account(self, req, job: Job) -> None:
        # per-tier hits are the engine's own count, taken when it first served the call
        hits = {"device": req.device_hit, "host": req.host_hit, "disk": req.disk_hit}
        self.metrics.served(req.call.input_length, len(job.tokens), hits, req.recomputed,
                            job.stop_reason == CANCELLED)

    def _record(self, run: Run, job: Job, hash_ids: list[int], arrival: float) -> None:
        if self.recorder is None:
            return
        wait = None if run.last_finish is None else max(0.0, arrival - run.last_finish)
        run.calls.append(Call(run.record_id, job.step, job.agent, len(job.prompt_ids), len(job.tokens),
                              list(hash_ids), workload="serve", t=round(arrival - self.origin, 6),
                              tool_wait=None if wait is None else round(wait, 6),
                              context=job.context if self.record_context else None))

    def _reap(self, now: float) -> int:
        runs = self.table.expired(now)
        for run in runs:
            self._end_run(run)
        return len(runs)

    def _end_key(self, key: str) -> bool:
        try:
            run = self.table.request_end(key)
        except KeyError:
            return False
        if run is not None:
            self._end_run(run)
        return True

    def _end_run(self, run: Run) -> None:
        self.backend.end_workflow(run.wf)
        self.table.remove(run)
        self.metrics.workflows_ended.labels(reason=run.ending).inc()
        if self.recorder is not None:
            self.recorder.record(run.calls)

    def _shutdown(self) -> None:
        self.backend.cancel_all()
        deadline = time.monotonic() + 10.0
        while self.backend.busy() and time.monotonic() < deadline:
            self.backend.step()
        for run in self.table.all_live():
            if run.in_flight == 0:
                self._end_run(run)
        if self.recorder is not None:
            self.recorder.close()
