"""A call being served: what the engine knows and measures about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pbkv.cache import Move, Node
from pbkv.engine.sampling import Sampling
from pbkv.trace import Call

# Where a prompt's KV can come from, in the order of per-tier hit lists: the three local tiers
# (indexed by `pbkv.cache.Tier`) and the directory shared between engines (`engine/shared_kv.py`).
HIT_TIERS = ("device", "host", "disk", "shared")
SHARED = 3


@dataclass(slots=True, eq=False)
class Request:
    call: Call
    workflow: int
    on_done: Callable[[Request], None]
    # generation settings (the real engine; the simulator ignores them): see pbkv.engine.sampling
    sampling: Sampling | None = None
    on_token: Callable[[Request, int], bool] | None = None   # True: stop after this token
    finish_reason: str | None = None   # set once, right before on_done ("length", "stop", ...)
    error: str | None = None           # with finish_reason "error": what failed ("Type: message")
    # when the call was issued: the driver stamps it (a call issued while the engine was busy,
    # e.g. during a long prefill pass, arrived then, not when the engine next looked); None:
    # the engine stamps the moment it hears of it (`EngineBase.submit`)
    arrival: float | None = None
    # cache state
    node: Node | None = None        # deepest locked node of its prompt (the request's pin)
    move: Move | None = None        # pending load of its prefix from host/disk
    loading: bool = False
    counted: bool = False           # hits were counted: at its admission for prefill (`count_hits`)
    # host and disk tokens its own loads moved to the device that its pin (`node`) still holds:
    # they count as hits of those tiers at admission (a released pin's prefix may be lost meanwhile)
    loaded: tuple[int, int] = (0, 0)
    reserved: int = 0               # device tokens held: new prompt tokens + outputs
    cached: int = 0                 # prompt tokens whose KV is on the device at prefill
    # measurements (tokens of the prompt by where its KV came from; seconds)
    device_hit: int = 0
    host_hit: int = 0
    disk_hit: int = 0
    shared_hit: int = 0             # loaded from the shared directory (after the local tiers' prefix)
    recomputed: int = 0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    # decode bookkeeping
    join_step: int = 0
    finish_step: int = 0
    # what a real engine produced (pbkv.engine.hf: output token ids, logits, hidden state)
    result: object = None

    def count_hits(self, cached: int, shared: int = 0) -> None:
        """Record where the prompt's KV came from, when the request is admitted for its prefill:
        `cached` prompt tokens on the device then, of which the `loaded` ones came from host and
        disk, and `shared` more read from the shared tier. The rest is recomputed: `recomputed`
        is what the prefill computes, whatever happened to a prefix while the request waited."""
        host, disk = self.loaded
        self.counted = True
        self.device_hit, self.host_hit, self.disk_hit, self.shared_hit = cached - host - disk, host, disk, shared
        self.recomputed = self.call.input_length - cached - shared

    def hits(self) -> dict[str, int]:
        """Prompt tokens whose KV was reused, by tier name (`HIT_TIERS`)."""
        return dict(zip(HIT_TIERS, (self.device_hit, self.host_hit, self.disk_hit, self.shared_hit)))
