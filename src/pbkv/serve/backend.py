"""The serving side of the real engine: jobs (the server's view of a generation) mapped onto
`HFEngine`'s public step-wise API (`step`, `cancel`, `Request.sampling`, `Request.on_token`).

`HFEngine.run()` serves until nothing is left (a replay's driver submits everything through it);
a server must interleave new arrivals, stop a generation at EOS or at a stop string, and drop a
request whose client went away. All of that is the engine's own API:
- `step()` is one engine iteration (the same loop `run()` repeats);
- each job's `Sampling` (temperature, top_p, seed, max new tokens, ignore_eos) rides on its
  request; EOS ids are the engine's (`EngineOptions.eos_token_ids`); stop strings are decided by
  the job's `on_token` (the worker's detokenizer), which returns True to stop;
- `cancel()` ends a queued, loading or running request at once and frees its KV space; a queue
  head that can never fit (`Stuck`) is cancelled with "error".

Invariant: every submitted job gets exactly one `on_done(job, reason, req)` call, on the engine
thread; a job's tokens arrive through `on_token` before it, in order.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Callable

from pbkv.cache import Capacities, RadixTree, Tier, TieredCache
from pbkv.engine.hf import EngineOptions, HFEngine, LoadedModel, Stuck, block_hashes
from pbkv.engine.request import Request
from pbkv.engine.sampling import CANCELLED, ERROR, Sampling
from pbkv.policy import Policy
from pbkv.trace import Call

__all__ = ["CANCELLED", "ERROR", "Job", "ServingEngine"]


@dataclass(eq=False)
class Job:
    """One generation. Set by the caller: the prompt and sampling; by the worker: the rest."""

    prompt_ids: list[int]
    sampling: Sampling                     # max_new_tokens must be set (the server's max_tokens)
    on_token: Callable[["Job", int], bool] = lambda job, token: False   # True: stop after this token
    on_done: Callable[["Job", str, Request], None] = lambda job, reason, req: None
    workflow: int = -1
    record_id: str = ""
    step: int = 0
    agent: str = "default"
    context: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    tokens: list[int] = field(default_factory=list)   # generated tokens (stop tokens excluded)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_new_tokens


class ServingEngine:
    """Owns the cache, the engine and the jobs; every method runs on the engine thread."""

    def __init__(self, lm: LoadedModel, policy: Policy, capacities: Capacities, block_size: int = 16,
                 disk_dir=None, clock=None, max_running: int = 64, eos_ids=frozenset()):
        self.lm, self.policy, self.block_size = lm, policy, block_size
        self.cache = TieredCache(RadixTree(block_size), capacities, policy)
        self.engine = HFEngine(lm, self.cache, policy, clock=clock, disk_dir=disk_dir,
                               options=EngineOptions(max_running=max_running, eos_token_ids=frozenset(eos_ids)))
        self.jobs: dict[int, Job] = {}   # id(request) -> its job, until the job's on_done
        self._rng = secrets.randbits(63)
        self.submitted = 0
        self.peak_running = 0   # most requests generating at once (batching at work)

    @property
    def capacity(self) -> Capacities:
        return self.cache.capacity

    # ------------------------------------------------------------------ workflows and requests

    def start_workflow(self, wf: int, record_id: str) -> None:
        self.engine.start_workflow(wf, record_id)

    def end_workflow(self, wf: int) -> None:
        self.engine.end_workflow(wf)

    def submit(self, job: Job) -> Request:
        ids, sampling = job.prompt_ids, job.sampling
        call = Call(job.record_id, job.step, job.agent, len(ids), job.max_tokens,
                    block_hashes(ids, self.block_size), context=job.context)
        if (sampling.temperature or 0) > 0 and sampling.seed is None:  # unseeded: a fresh draw each time
            self._rng += 1
            sampling = replace(sampling, seed=self._rng)

        def on_token(req: Request, token: int) -> bool:
            job.tokens.append(token)
            return job.on_token(job, token)
        req = Request(call=call, workflow=job.workflow, on_done=self._done, sampling=sampling, on_token=on_token)
        self.jobs[id(req)] = job
        self.engine.submit(req, ids)
        self.submitted += 1
        return req

    def cancel(self, req: Request) -> bool:
        """End `req` now (queued, loading or running) and free its KV space; False if it ended."""
        return self.engine.cancel(req)

    def cancel_all(self) -> None:
        """Cancel every request the engine holds (shutdown)."""
        for req in self.engine.requests:
            self.engine.cancel(req)

    # ------------------------------------------------------------------ the loop

    def busy(self) -> bool:
        return self.engine.busy

    def queued(self) -> int:
        return self.engine.queue_depth

    def running(self) -> int:
        return self.engine.running_count

    def step(self) -> None:
        """One engine iteration. A queue head that can never get device space is refused (the
        server checks sizes before submitting, so this only happens when pins hold the device)."""
        self.peak_running = max(self.peak_running, self.engine.running_count)  # the batch about to decode
        try:
            self.engine.step()
        except Stuck as e:
            req = e.request
            self.jobs[id(req)].error = (
                f"the prompt ({req.call.input_length} tokens) plus max_tokens ({req.call.output_length}) "
                f"does not fit the device KV space ({self.cache.capacity.device} tokens) now")
            self.engine.cancel(req, ERROR)

    def _done(self, req: Request) -> None:
        job = self.jobs.pop(id(req))
        job.stop_reason = req.finish_reason
        job.on_done(job, job.stop_reason, req)

    def fail_all(self, message: str) -> None:
        """The engine raised: end every job with an error (their clients get a 500)."""
        for req in self.engine.requests:
            job = self.jobs.get(id(req))
            if job is None:
                continue
            job.error = message
            try:
                self.engine.cancel(req, ERROR)  # releases its space and pins; the policy hears the end
            except Exception:  # noqa: BLE001 - the state is already broken: still answer the client
                if self.jobs.pop(id(req), None) is not None:
                    job.stop_reason = ERROR
                    job.on_done(job, ERROR, req)

    def device_usage(self) -> list[int]:
        return list(self.cache.usage)

    def close(self) -> None:
        self.engine.close()


def tier_names() -> list[tuple[Tier, str]]:
    return [(Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.DISK, "disk")]
