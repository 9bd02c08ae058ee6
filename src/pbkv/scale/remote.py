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

Workflow ends: a call with `workflow_done` ends its run on the replica that served it; other
replicas that served calls of that workflow (tracked in `visited`) are told to end theirs too,
and `POST /v1/workflows/{id}/end` is broadcast to every replica.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from ray.exceptions import RayActorError

from pbkv.engine.hf import ERROR, block_hashes
from pbkv.scale.failover import Action, decide, route_hints
from pbkv.serve.generate import REPLICA_FAILED
from pbkv.serve.jobs import Done, Job

log = logging.getLogger("pbkv.scale")
MAX_VISITED = 100_000   # workflows remembered for ending elsewhere (ones that end idle are never popped)


def replica_lost(exc: BaseException | None) -> bool:
    """The replica process died or cannot be reached (as opposed to an error it raised)."""
    return isinstance(exc, RayActorError)


class RemoteWorker:
    def __init__(self, handle, block_size: int, retried, failed, max_retries: int = 1):
        self.handle = handle
        self.stream = handle.options(method_name="generate", stream=True)
        self.block_size, self.max_retries = block_size, max_retries
        self.retried, self.failed = retried, failed   # prometheus counters of the ingress
        self.in_flight = 0
        self.tasks: dict[int, asyncio.Task] = {}
        self.visited: dict[str, set[str]] = {}
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ EngineWorker's API

    def submit(self, job: Job) -> Job:
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        self.in_flight += 1
        task = asyncio.create_task(self._pump(job))
        self.tasks[id(job)] = task
        task.add_done_callback(lambda _: self._ended(job))
        return job

    def _ended(self, job: Job) -> None:
        self.in_flight -= 1
        self.tasks.pop(id(job), None)

    def cancel(self, job: Job) -> None:
        """The client went away: stop reading (which cancels the replica's stream and its job)."""
        task = self.tasks.get(id(job))
        if task is not None:
            task.cancel()

    def end_workflow(self, workflow_id: str) -> asyncio.Future:
        """Resolves to whether any replica had a run of `workflow_id` (and ended it)."""
        self.visited.pop(workflow_id, None)
        return asyncio.ensure_future(self._broadcast_end(workflow_id))

    async def _broadcast_end(self, workflow_id: str) -> bool:
        results = await self.handle.broadcast("end_workflow", workflow_id).results_async(return_exceptions=True)
        return any(r is True for r in results)

    # ------------------------------------------------------------------ one job

    def route(self, job: Job) -> dict:
        workflow_id = job.hints.workflow_id or f"call-{secrets.token_hex(8)}"   # a one-call workflow
        return route_hints(workflow_id, job.hints.agent, block_hashes(job.prompt_ids, self.block_size),
                           len(job.prompt_ids), job.sampling.max_new_tokens)

    async def _pump(self, job: Job) -> None:
        route, retries = self.route(job), 0
        while True:
            done, replica, sent, exc = await self._attempt(job, route)
            workflow_id = job.hints.workflow_id
            if replica is not None and workflow_id is not None:
                if len(self.visited) > MAX_VISITED:
                    self.visited.clear()
                self.visited.setdefault(workflow_id, set()).add(replica)
            if done is not None:
                if job.hints.done and workflow_id is not None:
                    self._end_elsewhere(workflow_id, replica)
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

    async def _attempt(self, job: Job, route: dict):
        """One streamed call: (its Done or None, the replica it ran on, whether text reached the
        client, the exception that ended it). Text of a plain answer is held back until its Done."""
        copy = Job(job.prompt_ids, job.sampling, job.hints, job.stops, job.context, streamed=job.streamed)
        gen = self.stream.remote(route, copy)
        replica, sent, held = None, False, []
        try:
            async for event in gen:
                if isinstance(event, dict):
                    replica = event.get("replica")
                elif isinstance(event, Done):
                    for piece in held:
                        job.events.put_nowait(piece)
                    job.events.put_nowait(event)
                    return event, replica, sent, None
                elif job.streamed:
                    job.events.put_nowait(event)
                    sent = True
                else:
                    held.append(event)
            return None, replica, sent, RuntimeError("the replica's stream ended without an answer")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - decided by the caller (failover.decide)
            return None, replica, sent, e

    def _end_elsewhere(self, workflow_id: str, served_by: str | None) -> None:
        """A `workflow_done` call ended the run where it ran; end the workflow's runs elsewhere."""
        others = self.visited.pop(workflow_id, set()) - {served_by}
        if others:
            task = asyncio.ensure_future(self._broadcast_end(workflow_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
