"""Background KV I/O, the engine's clock, and the speed estimates its decisions use.

- `Worker`: one FIFO thread for every KV transfer (loads up, disk writes, file deletes), so
  transfers overlap with model compute on the main thread (torch releases the GIL in copies and
  file reads). FIFO order matters: a file is deleted only after its write, and a load queued
  after a write reads the finished file. `inline=True` runs each task at submit (deterministic).
- `WallClock` / `ManualClock`: time is injected. The wall clock skips idle gaps (every workflow
  waiting on a tool) instead of sleeping; a test's manual clock moves only when told.
- `Rates`: running estimates (exponential averages of what was measured in this process) of
  prefill tokens/s, load bytes/s per source tier (the shared directory included) and
  decode-step seconds.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pbkv.cache import Move, Tier


class Worker:
    def __init__(self, inline: bool = False):
        self.inline = inline
        self._pool = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="pbkv-kv-io")

    def submit(self, fn, *args, **kwargs) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args, **kwargs)
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the future's reader, like a pool does
            fut.set_exception(e)
        return fut

    def drain(self) -> None:
        """Wait until every task submitted so far has run."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class WallClock:
    """Seconds since creation, plus every idle gap skipped with `skip_to`."""

    def __init__(self):
        self._t0 = time.perf_counter()
        self.skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0 + self.skipped

    def skip_to(self, when: float) -> None:
        gap = when - self.now()
        if gap > 0:
            self.skipped += gap


class ManualClock:
    """A clock that moves only by `skip_to` / `advance` (tests)."""

    def __init__(self, start: float = 0.0):
        self.t = start
        self.skipped = 0.0

    def now(self) -> float:
        return self.t

    def skip_to(self, when: float) -> None:
        if when > self.t:
            self.skipped += when - self.t
            self.t = when

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Rates:
    """Speed estimates; priors until something was measured (measurements replace them fast)."""

    kv_bytes: int                               # KV bytes per token
    prefill_tps: float = 2000.0                 # prefill tokens per second
    # bytes/s by source: device, host, disk, shared directory (`pbkv.engine.request.HIT_TIERS`)
    load_bps: list[float] = field(default_factory=lambda: [1e12, 5e9, 1e9, 5e8])
    load_latency: float = 2e-3                  # fixed seconds per load
    decode_step: float = 0.01                   # seconds per decode step (all running requests)
    alpha: float = 0.3                          # weight of the newest measurement
    prefills: int = 0                           # prefill measurements taken (0: prefill_tps is the prior)

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:  # tiny prefills are overhead, not throughput
            self.prefill_tps = self._mix(self.prefill_tps, tokens / seconds)
            self.prefills += 1

    def saw_load(self, tier: int, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.load_bps[tier] = self._mix(self.load_bps[tier], nbytes / seconds)

    def saw_decode(self, seconds: float) -> None:
        if seconds > 0:
            self.decode_step = self._mix(self.decode_step, seconds)

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tps

    def load_seconds(self, tokens_by_tier: list[int]) -> float:
        return self.load_latency + sum(t * self.kv_bytes / self.load_bps[tier]
                                       for tier, t in enumerate(tokens_by_tier) if t)

    def prefetch_budget(self) -> int:
        """Host tokens the link moves during one decode step."""
        return int(self.load_bps[Tier.HOST] * self.decode_step / self.kv_bytes)


@dataclass(eq=False)
class Transfer:
    """A move up in flight: `req` is the request waiting for it (None for a prefetch)."""

    move: Move
    future: Future
    eta: float            # clock time by which the engine expects it done
    req: object = None
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])


@dataclass
class LoadResult:
    tensors: dict[int, torch.Tensor]      # node id -> KV on the device
    errors: dict[int, str]                # node id -> why it could not be read
    bytes_by_tier: list[int]
    seconds: float


def load_task(store, entries: list[tuple[int, object]]) -> LoadResult:
    """(worker thread) Read every entry of a move; an unreadable one is reported, not raised."""
    from pbkv.engine.hf.kvstore import CorruptKV
    start = time.perf_counter()
    tensors, errors, nbytes, files = {}, {}, [0, 0, 0], {}
    for node_id, kv in entries:
        try:
            t = store.read(kv, files)
        except CorruptKV as e:
            errors[node_id] = str(e)
            continue
        tensors[node_id] = t
        nbytes[kv.tier] += t.numel() * t.element_size()
    if store.device.type == "cuda":
        torch.cuda.current_stream(store.device).synchronize()  # data usable once the future is done
    return LoadResult(tensors, errors, nbytes, time.perf_counter() - start)
