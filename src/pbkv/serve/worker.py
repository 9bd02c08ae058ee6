"""The engine thread: one FCFS command queue in, per-job asyncio queues out.

The event loop never touches the engine, the cache, the policy or the workflow table: it puts
commands (`commands.py`: `Submit`, `Cancel`, `Invoke`, `Stop`) on a thread-safe queue, and the
engine thread answers through `loop.call_soon_threadsafe` into each job's `asyncio.Queue` (or a
`concurrent.futures.Future`). So a slow forward pass never blocks the event loop, and no lock
guards engine state: one thread owns it.

The thread drains every queued command before each engine step (arrival order = submission
order: FCFS), ends idle workflows by the injected clock, then runs one `HFEngine.step()` (one
prefill, or one decode step of every running request: continuous batching). With no work it
blocks on the queue (up to `idle_wait` seconds, so idle workflows still expire without traffic).

Each job becomes one `Request` of its workflow run (`HFEngine`'s step-wise API); EOS ids are the
engine's, stop strings the job's detokenizer's (`on_token` returns True to stop); a queue head
that can never fit (`Stuck`) or an engine failure ends jobs with "error". The engine isolates a
failure of one request's own work (its sampling, its `on_token` (the detokenizer), its forward
pass): that request alone ends with "error" (`Request.error`: the client's 500 says why), freeing
its reservation, its pin and its workflow's in-flight count; the others go on. Only a failure of
shared state leaves `step()`: then every job is ended (`_fail_all`), so none is left unanswered.
Invariant: every submitted job gets exactly one `Done`, after its text, in order.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable

from pbkv.engine.hf import CANCELLED, ERROR, HFEngine, Sampling, Stuck, block_hashes
from pbkv.engine.request import Request
from pbkv.serve.commands import Cancel, Invoke, Stop, Submit
from pbkv.serve.jobs import Done, Job
from pbkv.serve.metrics import Metrics
from pbkv.serve.recorder import TraceRecorder
from pbkv.serve.tokenizer import Detokenizer, Tokenizer
from pbkv.serve.workflows import Run, WorkflowTable
from pbkv.trace import Call

log = logging.getLogger("pbkv.serve")


class EngineWorker:
    def __init__(self, engine: HFEngine, tokenizer: Tokenizer, table: WorkflowTable, metrics: Metrics,
                 recorder: TraceRecorder | None = None, clock: Callable[[], float] = time.monotonic,
                 record_context: bool = False, idle_wait: float = 1.0):
        self.engine, self.tok, self.table, self.metrics = engine, tokenizer, table, metrics
        self.recorder, self.clock, self.idle_wait = recorder, clock, idle_wait
        self.record_context = record_context
        self.learner = None              # the policy's TrafficLearner, if any (told at shutdown)
        self.unrecorded = 0              # runs still open at shutdown, left out of --record
        self.origin = clock()
        self.jobs: dict[int, Job] = {}   # id(request) -> its job, until the job's Done
        self.peak_running = 0            # most requests generating at once (batching at work)
        self._seed = secrets.randbits(63)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="pbkv-engine", daemon=True)
        self._count_lock = threading.Lock()
        self.in_flight = 0   # jobs submitted and not yet done (for the queue limit and /metrics)

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue `job`; read its events from `job.events`."""
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        self._count(+1)
        self._q.put(Submit(job))
        return job

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self.in_flight += delta

    def check_ready(self) -> None:
        """Whether a call can be taken now: always, the engine runs in this process (the
        replicas' worker, `pbkv.scale.remote.RemoteWorker`, raises 503 while none runs)."""

    def cancel(self, job: Job) -> None:
        self._q.put(Cancel(job))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the engine thread (after every command queued before); its result."""
        future: Future = Future()
        self._q.put(Invoke(fn, future))
        return future

    def expire_idle(self) -> Future:
        """End idle workflows now (the thread also does it about every second); how many ended."""
        return self.call(lambda: self._reap(self.clock()))

    def end_workflow(self, workflow_id: str) -> Future:
        """`POST /v1/workflows/{workflow_id}/end`: resolves to False for an unknown (or ended) id."""
        return self.call(lambda: self._end_workflow_id(workflow_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or runs, end every workflow (the policy hears it), close the recorder."""
        if self._thread.is_alive():
            self._q.put(Stop())
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread: the loop

    def _main(self) -> None:
        next_reap = self.clock()
        while True:
            for cmd in self._commands():
                if isinstance(cmd, Stop):
                    return self._shutdown()
                self._command(cmd)
            now = self.clock()
            if now >= next_reap:
                next_reap = now + min(1.0, self.table.idle_timeout / 4)
                try:
                    self._reap(now)
                except Exception:  # noqa: BLE001 - the engine thread must outlive a failed workflow end
                    log.exception("ending idle workflows failed")
            if self.engine.busy:
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - answer the clients, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"the engine failed: {type(e).__name__}: {e}")

    def _commands(self):
        """Every queued command, in order; with nothing to run, waits up to `idle_wait` for one."""
        try:
            cmd = self._q.get_nowait() if self.engine.busy else self._q.get(timeout=self.idle_wait)
        except queue.Empty:
            return
        while True:
            yield cmd
            try:
                cmd = self._q.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd: Submit | Cancel | Invoke) -> None:
        try:
            match cmd:
                case Submit(job):
                    self._submit(job)
                case Cancel(job):
                    if job.req is not None:  # the engine ignores a request that already ended
                        self.engine.cancel(job.req)
                case Invoke(fn, future):
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
        except Exception as e:  # noqa: BLE001 - one bad command must not stop the engine thread
            log.exception("command %s failed", type(cmd).__name__)
            if isinstance(cmd, Submit) and cmd.job.req is None:  # it never reached the engine
                self._count(-1)
                cmd.job.put(Done(ERROR, len(cmd.job.prompt_ids), error=f"{type(e).__name__}: {e}"))

    def _step(self) -> None:
        """One engine iteration. A queue head that can never get device space is refused (the
        server checks sizes before submitting, so this only happens when pins hold the device)."""
        self.peak_running = max(self.peak_running, self.engine.running_count)  # the batch about to decode
        try:
            self.engine.step()
        except Stuck as e:
            req = e.request
            self.jobs[id(req)].error = (
                f"the prompt ({req.call.input_length} tokens) plus max_tokens ({req.call.output_length}) "
                f"does not fit the device KV space ({self.engine.cache.capacity.device} tokens) now")
            self.engine.cancel(req, ERROR)

    def _fail_all(self, message: str) -> None:
        """The engine raised: end every job with an error (their clients get a 500), also a job
        whose request the engine no longer holds but never answered (it failed mid-end)."""
        for req in self.engine.requests:
            job = self.jobs.get(id(req))
            if job is None:
                continue
            job.error = message
            try:
                self.engine.cancel(req, ERROR)  # releases its space and pins; the policy hears the end
            except Exception:  # noqa: BLE001 - the state is already broken: still answer the client
                if id(req) in self.jobs:
                    req.finish_reason = ERROR
                    self._done(req)
        for key, job in list(self.jobs.items()):   # orphans: answered here, exactly once
            del self.jobs[key]
            self._count(-1)
            job.put(Done(ERROR, len(job.prompt_ids), error=message))
            try:
                if self.table.finish(job.run, self.clock()):
                    self._end_run(job.run)
            except Exception:  # noqa: BLE001 - answering the clients comes first
                log.exception("ending the run of a failed job failed")

    # ------------------------------------------------------------------ engine thread: jobs

    def _submit(self, job: Job) -> None:
        job.arrival = self.clock()
        run, step, new = self.table.begin(job.hints, job.arrival, job.context)
        if new:
            self.metrics.workflows_started.inc()
            self.engine.start_workflow(run.workflow, run.record_id)
        job.run, job.detok = run, Detokenizer(self.tok, job.stops)
        ids = job.prompt_ids
        call = Call(run.record_id, step, run.agents[step], len(ids), job.sampling.max_new_tokens,
                    block_hashes(ids, self.engine.tree.block_size), context=job.context)
        req = Request(call=call, workflow=run.workflow, on_done=self._done, sampling=self._seeded(job.sampling),
                      on_token=self._token)
        self.jobs[id(req)] = job
        try:
            self.engine.submit(req, ids)
        except Exception:
            del self.jobs[id(req)]
            if self.table.finish(run, self.clock()):
                self._end_run(run)
            raise
        job.req = req

    def _seeded(self, sampling: Sampling) -> Sampling:
        """Unseeded sampling gets a fresh seed per call (else the engine derives one from the call)."""
        if (sampling.temperature or 0) > 0 and sampling.seed is None:
            self._seed += 1
            return replace(sampling, seed=self._seed)
        return sampling

    def _token(self, req: Request, token: int) -> bool:
        job = self.jobs[id(req)]
        text = job.detok.push(token)
        if text:
            job.put(text)
        return job.detok.stopped

    def _done(self, req: Request) -> None:
        job, reason = self.jobs.pop(id(req)), req.finish_reason
        tail = job.detok.finish()
        if tail and reason != ERROR:
            job.put(tail)
        completion = len(req.result.tokens) if req.result is not None else 0
        # per-tier hits are the engine's own count, taken when it admitted the call; a call that
        # ended before that (cancelled while it waited for room or a load) served no prompt tokens, so
        # none are counted: hits + recomputed == prompt tokens, in the metrics as per call
        hits = req.hits()
        prompt = req.call.input_length if req.counted else 0
        self.metrics.served(prompt, completion, hits, req.recomputed, reason == CANCELLED)
        self._record(job, req, completion)
        self._count(-1)
        try:  # the run ends (policy told, trace written) before the answer: a client that has it sees the end
            if self.table.finish(job.run, self.clock()):
                self._end_run(job.run)
        finally:
            job.put(Done(reason, len(job.prompt_ids), completion, hits, job.error or req.error))

    def _record(self, job: Job, req: Request, completion: int) -> None:
        # a call never served (its client left while it waited for room: never prefilled) is no
        # call of the trace, as it adds nothing to /metrics: a replay would prefill it; the
        # recorder numbers the run's recorded calls 0..n-1
        if self.recorder is None or not req.counted:
            return
        run, call = job.run, req.call
        wait = None if run.last_finish is None else round(max(0.0, job.arrival - run.last_finish), 6)
        run.calls.append(replace(call, output_length=completion, hash_ids=list(call.hash_ids), workload="serve",
                                 t=round(job.arrival - self.origin, 6), tool_wait=wait,
                                 context=call.context if self.record_context else None))

    # ------------------------------------------------------------------ engine thread: workflow runs

    def _reap(self, now: float) -> int:
        runs = self.table.expired(now)
        for run in runs:
            self._end_run(run)
        return len(runs)

    def _end_workflow_id(self, workflow_id: str) -> bool:
        try:
            run = self.table.request_end(workflow_id)
        except KeyError:
            return False
        if run is not None:
            self._end_run(run)
        return True

    def _end_run(self, run: Run) -> None:
        self.engine.end_workflow(run.workflow)
        self.table.remove(run)
        self.metrics.workflows_ended.labels(reason=run.ending).inc()
        if self.recorder is None:
            return
        if run.ending == "shutdown":   # cut short: as a whole workflow it would teach an early end
            self.unrecorded += 1
        elif not self.recorder.record(run.calls):
            self.metrics.record_errors.inc()   # logged by the recorder; the calls were served

    def _shutdown(self) -> None:
        for req in self.engine.requests:
            self.engine.cancel(req)
        deadline = time.monotonic() + 10.0
        while self.engine.busy and time.monotonic() < deadline:
            self._step()
        live = self.table.all_live()
        # first the runs their clients ended (done, endpoint): finished, so learned; the rest were
        # still open, cut short by the stop, and a learner must not take them as finished
        for run in sorted(live, key=lambda r: r.ending == "shutdown"):
            if run.ending == "shutdown" and self.learner is not None:
                self.learner.taking = False
            if run.in_flight == 0:
                self._end_run(run)
        if self.recorder is not None:
            if self.unrecorded:
                log.info("%d workflow(s) still running at shutdown not recorded (cut short, not finished)",
                         self.unrecorded)
            self.recorder.close()
