"""The ingress's engine: `EngineWorker`'s event-loop API over a Ray Serve deployment of replicas.

`pbkv.serve.generate` and `pbkv.serve.app` drive a worker through `submit(job)` (then read
`job.events`: text pieces, then one `Done`), `cancel(job)`, `in_flight` and `end_workflow(id)`.
`RemoteWorker` keeps that contract with the work done by a replica (`pbkv.scale.replica`): each
job becomes one streamed `generate(route, job)` call whose `route` dict (workflow id, agent,
chained block hashes of the prompt, token counts) is what the deployment's request router reads
to choose the replica. The hashes are `pbkv.engine.hf.tokens.block_hashes` of the prompt the
ingress tokenized, the same ids the replica's engine keys its cache with (the replica does not
tokenize again: it receives the token ids).

Failures (`pbkv.scale.failover`): a job whose replica is lost before its first text reached the
client is sent once more, avoiding that replica; otherwise it ends with a `replica_failed`
`Done`. A plain answer's text is held until its `Done`, so it is never half-delivered.
Invariant (as `EngineWorker`'s): every submitted job that is not cancelled gets exactly one
`Done`, after its text, in order; `in_flight` counts submitted jobs not yet ended or cancelled.

Workflow ends, as in one process (`pbkv.serve.workflows`: a run ends once a `workflow_done` call
or the endpoint ended it and its last call in flight finished): the ingress keeps a `Flow` per
client workflow id (`visited`, bounded by `MAX_VISITED`, idle longest forgotten first): the
replicas its calls were placed on (noted at each call's first event, `{"replica": id}`, not when
it finishes) and its calls not finished yet. A `workflow_done` call ends its run on the replica
that serves it and detaches the flow (a later call with that id starts a new one, as in one
process); `POST /v1/workflows/{id}/end` is broadcast to every replica at once (a replica with
calls of it in flight ends its run after them) and detaches it too. Once an ended flow's last call
finishes, the end is broadcast to the replicas (each ends its run of that id, if any), unless its
only replica was the one that ran the `workflow_done` call and no other call of the run was in
flight then (that replica's run already ended: nothing to do). So a call still running, or still
waiting to be placed, when the workflow ended no longer leaves a run open on another replica
until the idle timeout (cut short at shutdown: never recorded nor learned from). Not exact where
a new run of the same id starts before the old run's last call finished: replicas know runs only
by id, so that end would cut the new run; it is not sent, and the old run's part on another
replica ends by idle timeout (a new call of the id that reaches it joins that part instead).
A call's flow is opened when it is submitted and closed when its task ends (cancelled before it
ran included), so an end that comes in between sees the call. `visited` forgets, past its bound,
only flows with no call in flight.

Broadcasts (`broadcast`, also /metrics'): Ray Serve's `handle.broadcast(m).results_async(...)` is
all or nothing (one frozen replica times the whole call out; with no replica running it raises
`DeploymentUnavailableError` before any answer exists). `broadcast` gives each replica its own
`REPLICA_TIMEOUT_S` (waited on together) and returns the answers that came; a replica that raised
or did not answer is logged and left out, never raised. When no replica answers a workflow end,
the endpoint gets a 503 `replicas_unavailable` with Retry-After (Ray is restarting them, or every
one is stuck), not a 404: nobody could say whether the workflow ran.

No replica running (all lost, and Ray cannot start new ones yet, or ever: a constructor that
raises is retried forever): Ray's router would hold a call in its queue with no time limit, and
the call would keep its `--max-queue` slot. So a call is refused at once with 503
`replicas_unavailable` (Retry-After) while the router knows no running replica (`check_ready`,
what /health reads), and a call already waiting to be placed gives up with the same answer once
no replica has run for `NO_REPLICA_WAIT_S` in a row (a restart faster than that still serves it).
This module imports without Ray (unit-tested with fake handles).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from pbkv.engine.hf import ERROR, block_hashes
from pbkv.scale.adapter import workflow_ended
from pbkv.scale.failover import Action, decide, route_hints
from pbkv.serve.errors import APIError
from pbkv.serve.generate import REPLICA_FAILED, REPLICAS_UNAVAILABLE, RETRY_AFTER_S as RETRY_AFTER_BY_CODE
from pbkv.serve.jobs import Done, HeldText, Job

log = logging.getLogger("pbkv.scale")
MAX_VISITED = 100_000   # workflows remembered for ending elsewhere (ones that end idle are never popped)
RETRY_AFTER_S = RETRY_AFTER_BY_CODE[REPLICAS_UNAVAILABLE]   # Ray restarts replicas in tens of seconds
NO_REPLICA_WAIT_S = 10.0   # a call waiting to be placed gives up after this long with no replica running
POLL_S = 0.25              # how often a waiting call asks whether any replica runs
REPLICA_TIMEOUT_S = 5.0   # a replica that has not answered a broadcast by then is left out of it


def replica_lost(exc: BaseException | None) -> bool:
    """The replica process died or cannot be reached (as opposed to an error it raised)."""
    from ray.exceptions import RayActorError   # here: this module imports without Ray (unit tests)
    return isinstance(exc, RayActorError)


def replicas_unavailable(message: str = "No engine replica answered (they may be restarting); retry later.") -> APIError:
    """No engine replica answered: nothing can be said about the request, retry it later."""
    return APIError(503, message, "server_error", None, REPLICAS_UNAVAILABLE,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


NOT_RUNNING = "No engine replica is running (Ray may be restarting them); retry later."


class NoReplica(Exception):
    """A call waited `NO_REPLICA_WAIT_S` to be placed while no replica ran."""


async def _replica_results(response) -> list:
    """The broadcast's per-replica results (each has `get_async()`). Ray 2.60's
    `DeploymentBroadcastResponse` has no public way to wait on each replica on its own: this is
    the step `results_async` takes before it gathers them (its public `results`/`results_async`
    take one timeout for all replicas). A Ray without that step gets the public all-or-nothing
    call: one frozen replica then times the whole broadcast out, which then counts as no answer
    (tests/test_scale_failures.py tests both paths, and that Ray still has the step)."""
    fetch = getattr(response, "_fetch_replica_results_async", None)
    if fetch is None:
        return [_Done(r) for r in await response.results_async(timeout_s=REPLICA_TIMEOUT_S, return_exceptions=True)]
    return await fetch()


class _Done:
    """A result already in hand, with the per-replica result's `get_async()`."""

    def __init__(self, value):
        self.value = value

    async def get_async(self):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


async def broadcast(handle, method: str, *args, timeout_s: float | None = None) -> list:
    """`method(*args)`'s answers from the replicas that answered within `timeout_s` (default
    `REPLICA_TIMEOUT_S`) each (in no given order); [] when no replica runs (or the deployment
    cannot be reached). Never raises an error of a replica or of Ray; a call that got fewer answers
    logs one warning."""
    timeout_s = REPLICA_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        results = await asyncio.wait_for(_replica_results(handle.broadcast(method, *args)), timeout_s)
    except Exception as exc:  # noqa: BLE001 - DeploymentUnavailableError, a timeout: no replica to ask
        log.warning("no engine replica to call %s on (%s: %s)", method, type(exc).__name__, exc)
        return []
    outcomes = await asyncio.gather(*(asyncio.wait_for(r.get_async(), timeout_s) for r in results),
                                    return_exceptions=True)
    answers = [o for o in outcomes if not isinstance(o, BaseException)]
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        reasons = sorted({"timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__ for e in failed})
        log.warning("%d of %d engine replicas gave no answer to %s (%s; each had %g s): left out",
                    len(failed), len(outcomes), method, ", ".join(reasons), timeout_s)
    return answers


@dataclass(eq=False)
class Flow:
    """The ingress's view of one run of a client workflow across the replicas (module docstring)."""

    replicas: set[str] = field(default_factory=set)   # where its calls were placed (running or finished)
    in_flight: int = 0            # its calls submitted and not finished (placed or still queued in Ray)
    ending: bool = False          # a workflow_done call or the endpoint ended it
    done_on: str | None = None    # the replica its workflow_done call was placed on (it ends its own run)
    shared: bool = False          # another call of the run was in flight when the workflow_done call was placed


class RemoteWorker:
    """`running()`: the replicas running now as the ingress's router knows them (None: unknown,
    never refused); see the module docstring."""

    def __init__(self, handle, block_size: int, retried, failed, max_retries: int = 1,
                 running: Callable[[], int | None] = lambda: None, metrics=None):
        self.handle, self.running = handle, running
        self.metrics = metrics   # the ingress's `Metrics`: served tokens counted from each answer
        self.stream = handle.options(method_name="generate", stream=True)
        self.block_size, self.max_retries = block_size, max_retries
        self.retried, self.failed = retried, failed   # prometheus counters of the ingress
        self.in_flight = 0
        self.tasks: dict[int, asyncio.Task] = {}
        self.visited: dict[str, Flow] = {}   # client workflow id -> its run now, idle longest first
        self._busy: dict[str, list[Flow]] = {}   # id -> its flows with calls in flight, oldest first
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ EngineWorker's API

    def submit(self, job: Job) -> Job:
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        self.in_flight += 1
        flow = self._open(job)   # at once, not in the task: an end that comes before it runs must see the call
        task = asyncio.create_task(self._serve(job, flow))
        self.tasks[id(job)] = task
        task.add_done_callback(lambda _: self._ended(job, flow))   # also when cancelled before it ran
        return job

    def _ended(self, job: Job, flow: Flow | None) -> None:
        self.in_flight -= 1
        self.tasks.pop(id(job), None)
        if flow is not None:
            self._close(flow, job.hints.workflow_id)

    def check_ready(self) -> None:
        """Raises 503 `replicas_unavailable` while no replica runs (as /health says then)."""
        if self.running() == 0:
            raise replicas_unavailable(NOT_RUNNING)

    def cancel(self, job: Job) -> None:
        """The client went away: stop reading (which cancels the replica's stream and its job)."""
        task = self.tasks.get(id(job))
        if task is not None:
            task.cancel()

    def end_workflow(self, workflow_id: str) -> asyncio.Future:
        """Resolves to whether the workflow had a run: a call of it still in flight here (queued
        in Ray or running; its run ends after it, as in one process) or a replica that answered
        had one (and ended it); raises `replicas_unavailable()` when none answered and no call
        of it is in flight."""
        flow = self.visited.pop(workflow_id, None)
        if flow is not None:
            flow.ending = True   # its calls in flight: ended again where they ran once they finish
        workflow_ended(getattr(self.handle, "app_name", None), workflow_id)   # this process's routers
        live = flow is not None and flow.in_flight > 0
        return asyncio.ensure_future(self._end_everywhere(workflow_id, live))

    async def _end_everywhere(self, workflow_id: str, live: bool = False) -> bool:
        answers = await self._broadcast_end(workflow_id)
        if not answers and not live:
            raise replicas_unavailable()
        return live or any(a is True for a in answers)

    async def _broadcast_end(self, workflow_id: str) -> list:
        """The answers of the replicas that answered in time (never raises: see `broadcast`)."""
        return await broadcast(self.handle, "end_workflow", workflow_id)

    # ------------------------------------------------------------------ one job

    def route(self, job: Job) -> dict:
        """The router's hints; a call without a workflow id is a one-call workflow, which ends
        with it (so the router never remembers it)."""
        one_call = job.hints.workflow_id is None
        workflow_id = f"call-{secrets.token_hex(8)}" if one_call else job.hints.workflow_id
        return route_hints(workflow_id, job.hints.agent, block_hashes(job.prompt_ids, self.block_size),
                           len(job.prompt_ids), job.sampling.max_new_tokens, done=one_call or job.hints.done)

    def _open(self, job: Job) -> Flow | None:
        """A call of a client workflow is submitted: its run's `Flow` (None without a workflow id),
        newest last in `visited`; past MAX_VISITED the workflow idle longest is forgotten
        (clearing them all forgot the running ones too). A `workflow_done` call ends the run: its
        flow leaves `visited`, so a later call with this id starts a new run, as in one process."""
        workflow_id = job.hints.workflow_id
        if workflow_id is None:
            return None
        flow = self.visited.pop(workflow_id, None) or Flow()
        if flow.in_flight == 0:
            self._busy.setdefault(workflow_id, []).append(flow)
        flow.in_flight += 1
        if job.hints.done:
            flow.ending = True
        else:
            self.visited[workflow_id] = flow
            if len(self.visited) > MAX_VISITED:
                self._forget_one()
        return flow

    def _forget_one(self) -> None:
        """Past MAX_VISITED: forget the flow idle longest with no call in flight (one with a call
        in flight must stay: its end would not reach the replica running that call). None idle:
        keep them all (then `visited` is bounded by the calls in flight)."""
        idle = next((w for w, f in self.visited.items() if f.in_flight == 0), None)
        if idle is not None:
            del self.visited[idle]

    @staticmethod
    def _placed_on(flow: Flow, replica: str, done: bool) -> None:
        """A call of `flow` was placed on `replica` (its first event): noted at once, so an end
        that comes while the call runs reaches that replica too."""
        flow.replicas.add(replica)
        if done:
            flow.done_on = replica
            flow.shared = flow.shared or flow.in_flight > 1

    def _close(self, flow: Flow, workflow_id: str) -> None:
        """A call of `flow` finished (answered, failed or cancelled). When it was the last call in
        flight of an ended run, the run ends on the replicas its calls ran on (module docstring),
        unless a new run of the same id has started here since: the end, by id, would end that
        one on its replica (the old run's part elsewhere then ends by idle timeout)."""
        flow.in_flight -= 1
        busy = self._busy.get(workflow_id, [])
        # a newer run: the one `visited` holds now, or one busy after this (a done call left `visited`)
        newer = self.visited.get(workflow_id) not in (None, flow) or busy[-1:] != [flow]
        if flow.in_flight == 0:
            busy.remove(flow)
            if not busy:
                self._busy.pop(workflow_id, None)
        if flow.ending and flow.in_flight == 0 and not newer and (
                flow.shared or not flow.replicas <= {flow.done_on}):
            self._end_elsewhere(workflow_id)

    async def _serve(self, job: Job, flow: Flow | None) -> None:
        route, retries = self.route(job), 0
        while True:
            done, replica, sent, exc = await self._attempt(job, route, flow)
            if done is not None:
                return
            if isinstance(exc, NoReplica):
                log.warning("no engine replica ran for %g s while a call waited: answered 503", NO_REPLICA_WAIT_S)
                job.events.put_nowait(Done(ERROR, len(job.prompt_ids), code=REPLICAS_UNAVAILABLE, error=NOT_RUNNING))
                return
            action = decide(replica_lost(exc), sent, retries, self.max_retries)
            if action is Action.RETRY:
                retries += 1
                self.retried.inc()
                log.warning("replica %s was lost before answering (%s): retrying the call", replica, exc)
                route = route | {"avoid": [replica]} if replica is not None else route
                continue
            if action is Action.FAIL:
                self.failed.inc()
                when = "while streaming this answer" if sent else f"after {retries} retry(s)"
                done = Done(ERROR, len(job.prompt_ids), code=REPLICA_FAILED, error=f"the engine replica "
                            f"{replica or '(unknown)'} serving this call was lost {when} ({type(exc).__name__})")
            else:
                done = Done(ERROR, len(job.prompt_ids), error=f"{type(exc).__name__}: {exc}")
            job.events.put_nowait(done)
            return

    async def _attempt(self, job: Job, route: dict, flow: Flow | None = None):
        """One streamed call: (its Done or None, the replica it ran on, whether text reached the
        client, the exception that ended it). Text of a plain answer is held back until its Done;
        its first piece goes on as a `HeldText` stamped with when it came from the replica (the
        server's time to first token, as in one process)."""
        copy = Job(job.prompt_ids, job.sampling, job.hints, job.stops, job.context, streamed=job.streamed)
        gen = self.stream.remote(route, copy)
        replica, sent, held = None, False, []
        try:
            event = await self._placed(gen)
            while True:
                if isinstance(event, dict):
                    replica = event.get("replica")
                    if flow is not None and replica is not None:
                        self._placed_on(flow, replica, job.hints.done)
                elif isinstance(event, Done):
                    self._count(event)
                    for piece in held:
                        job.events.put_nowait(piece)
                    job.events.put_nowait(event)
                    return event, replica, sent, None
                elif job.streamed:
                    job.events.put_nowait(event)
                    sent = True
                else:
                    held.append(event if held else HeldText(event, time.perf_counter()))
                event = await gen.__anext__()
        except StopAsyncIteration:
            return None, replica, sent, RuntimeError("the replica's stream ended without an answer")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except NoReplica as e:
            gen.cancel()   # before assignment Ray drops it from its queue
            return None, None, False, e
        except Exception as e:  # noqa: BLE001 - decided by the caller (failover.decide)
            return None, replica, sent, e

    def _count(self, done: Done) -> None:
        """A replica's answer, counted from its usage as its engine counted it (hits per tier plus
        recomputed tokens make the prompt tokens). An engine error is not counted: its usage does
        not say whether the engine served the prompt (its own counters say)."""
        if self.metrics is None or done.reason == ERROR:
            return
        hits = dict(done.cached or {})
        recomputed = max(0, done.prompt_tokens - sum(hits.values()))
        self.metrics.served(done.prompt_tokens, done.completion_tokens, hits, recomputed, cancelled=False)

    async def _placed(self, gen):
        """The stream's first event (the replica's id: the call was placed); raises `NoReplica`
        once no replica has been running for `NO_REPLICA_WAIT_S` in a row meanwhile."""
        first = asyncio.ensure_future(gen.__anext__())
        down_since = None
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=POLL_S)
                if done:
                    return first.result()
                if self.running() != 0:
                    down_since = None
                    continue
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= NO_REPLICA_WAIT_S:
                    raise NoReplica()
        finally:
            if not first.done():
                first.cancel()

    def _end_elsewhere(self, workflow_id: str) -> None:
        """An ended run's last call finished: end `workflow_id` on the replicas (in the
        background; never raises, see `broadcast`). A replica whose run already ended, or that
        never had one, answers False."""
        task = asyncio.ensure_future(self._broadcast_end(workflow_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
