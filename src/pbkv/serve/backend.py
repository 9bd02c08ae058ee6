"""The serving side of the real engine: `HFEngine` one iteration at a time, with per-request
sampling, stop conditions and cancellation.

`HFEngine.run()` serves until nothing is left (a replay's driver submits everything through it);
a server must interleave new arrivals, stop a generation at EOS or at a stop string, and drop a
request whose client went away. This adapter adds that without changing the engine:
- `step()` is one iteration of `HFEngine.run`'s loop, in the same order of priority (events,
  finished loads, one prefill, else prefetch + one decode step of every running request);
- `_emit` is overridden: each request samples with its own temperature / top_p / seed, and a
  `Job.on_token` callback decides after each token whether the request stops;
- requests that must stop are finished after the step through the engine's own `_finish`, so the
  cache is released and the policy hears `on_call_end` exactly as for a request that ran out.

Invariant: every submitted job gets exactly one `on_done(job, reason, req)` call, on the engine
thread; a job's tokens arrive through `on_token` before it, in order.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable

import torch

from pbkv.cache import Capacities, RadixTree, Tier, TieredCache
from pbkv.engine.hf import EngineOptions, HFEngine, LoadedModel, block_hashes
from pbkv.engine.request import Request
from pbkv.policy import Policy
from pbkv.trace import Call

STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


@dataclass(eq=False)
class Job:
    """One generation. Set by the caller: the prompt and sampling; by the worker: the rest."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    eos_ids: frozenset[int] = frozenset()
    on_token: Callable[["Job", int], bool] = lambda job, token: False   # True: stop after this token
    on_done: Callable[["Job", str, Request], None] = lambda job, reason, req: None
    workflow: int = -1
    record_id: str = ""
    step: int = 0
    agent: str = "default"
    context: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    tokens: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Greedy at temperature 0; else softmax(logits / T) cut to the top-p nucleus."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p   # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


class _Engine(HFEngine):
    """`HFEngine` whose tokens are sampled per job and reported as they come."""

    jobs: dict[int, Job]

    def _emit(self, seq, logits: torch.Tensor) -> None:
        job = self.jobs[id(seq.req)]
        token = sample(logits, job.temperature, job.top_p, job.gen)
        seq.req.result.tokens.append(token)
        if token in job.eos_ids:
            job.stop_reason = job.stop_reason or STOP
            return
        job.tokens.append(token)
        if job.on_token(job, token):
            job.stop_reason = job.stop_reason or STOP
        elif len(job.tokens) >= job.max_tokens:
            job.stop_reason = job.stop_reason or LENGTH


class ServingEngine:
    """Owns the cache, the policy's engine and the jobs; every method runs on the engine thread."""

    def __init__(self, lm: LoadedModel, policy: Policy, capacities: Capacities, block_size: int = 16,
                 disk_dir=None, clock=None, max_running: int = 64):
        self.lm, self.policy, self.block_size = lm, policy, block_size
        self.cache = TieredCache(RadixTree(block_size), capacities, policy)
        self._prompts: dict[int, list[int]] = {}    # id(call) -> token ids
        self.engine = _Engine(lm, self.cache, policy, tokenize=self._tokens_of, clock=clock,
                              options=EngineOptions(max_running=max_running), disk_dir=disk_dir)
        self.engine.jobs = {}
        self._rng = secrets.randbits(63)
        self.submitted = 0
        self.peak_running = 0   # most requests generating at once (batching at work)

    @property
    def capacity(self) -> Capacities:
        return self.cache.capacity

    def _tokens_of(self, call: Call) -> list[int]:
        return self._prompts[id(call)]

    # ------------------------------------------------------------------ workflows and requests

    def start_workflow(self, wf: int, record_id: str) -> None:
        self.engine.start_workflow(wf, record_id)

    def end_workflow(self, wf: int) -> None:
        self.engine.end_workflow(wf)

    def submit(self, job: Job) -> Request:
        ids = job.prompt_ids
        call = Call(job.record_id, job.step, job.agent, len(ids), job.max_tokens,
                    block_hashes(ids, self.block_size), context=job.context)
        self._prompts[id(call)] = ids
        if job.temperature > 0:
            self._rng += 1
            job.gen = torch.Generator().manual_seed(job.seed if job.seed is not None else self._rng)
        req = Request(call=call, workflow=job.workflow, on_done=self._done)
        self.engine.jobs[id(req)] = job
        self.engine.submit(req)
        self.submitted += 1
        return req

    def cancel(self, job: Job, req: Request) -> None:
        """Stop `job` as soon as possible (a queued one at once, a running one after this step)."""
        job.stop_reason = job.stop_reason or CANCELLED
        e = self.engine
        if req in e.waiting and not req.loading:
            e.waiting.remove(req)
            e._finish(req)

    # ------------------------------------------------------------------ the loop

    def busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or e._transfers)

    def queued(self) -> int:
        return len(self.engine.waiting)

    def running(self) -> int:
        return len(self.engine.running)

    def step(self) -> None:
        """One iteration of `HFEngine.run`, then finish the jobs that must stop."""
        e = self.engine
        e._fire_events()
        e._poll_transfers()
        if e.waiting and e._prefill_next():
            pass
        elif e.running:
            self.peak_running = max(self.peak_running, len(e.running))
            e._prefetch()
            e._decode_step()
        elif e._transfers:
            e._poll_transfers(block=True)
        elif e.waiting and not e._unpin_waiting():
            self._fail_head()
        self._sweep()

    def _sweep(self) -> None:
        e = self.engine
        for seq in list(e.running):
            if e.jobs[id(seq.req)].stop_reason is not None:
                e.running.remove(seq)
                e._finish(seq.req)

    def _fail_head(self) -> None:
        """Nothing runs and the oldest request cannot get device space: refuse it (the server
        checks sizes before submitting, so this only happens when pins hold the device)."""
        e = self.engine
        req = e.waiting.pop(0)
        job = e.jobs[id(req)]
        job.stop_reason = ERROR
        job.error = (f"the prompt ({req.call.input_length} tokens) plus max_tokens ({req.call.output_length}) "
                     f"does not fit the device KV space ({self.cache.capacity.device} tokens) now")
        e._finish(req)

    def _done(self, req: Request) -> None:
        job = self.engine.jobs.pop(id(req))
        self._prompts.pop(id(req.call), None)
        reason = job.stop_reason or LENGTH
        job.on_done(job, reason, req)

    def fail_all(self, message: str) -> None:
        """The engine raised: end every job with an error (their clients get a 500)."""
        e = self.engine
        reqs = [r for r in e.waiting if not r.loading] + [s.req for s in e.running]
        e.waiting = [r for r in e.waiting if r.loading]   # loads in flight finish, then these fail
        e.running.clear()
        for job in e.jobs.values():
            job.stop_reason, job.error = ERROR, message
        for req in reqs:
            try:
                e._finish(req)  # releases its space and pins; the policy hears the end
            except Exception:  # noqa: BLE001 - the state is already broken: still answer the client
                job = e.jobs.pop(id(req), None)
                if job is not None:
                    job.on_done(job, ERROR, req)

    def device_usage(self) -> list[int]:
        return list(self.cache.usage)

    def close(self) -> None:
        self.engine.close()


def tier_names() -> list[tuple[Tier, str]]:
    return [(Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.DISK, "disk")]
