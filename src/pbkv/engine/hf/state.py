"""The real engine's small records: errors, options, counters, a call's output, a running request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pbkv.engine import base
from pbkv.engine.request import Request

LOAD_RULES = ("auto", "load", "recompute")


class EngineError(RuntimeError):
    pass


class Stuck(EngineError):
    """Nothing runs, loads or is scheduled, and the oldest waiting request (`request`) cannot
    get device space even after queued requests released their pins. Nothing was changed: the
    caller may `cancel` that request and keep stepping."""

    def __init__(self, message: str, request: Request):
        super().__init__(message)
        self.request = request


@dataclass
class EngineOptions:
    load_rule: str = "auto"        # host/disk prefixes: auto | load | recompute (see admit.py)
    prefetch: bool = True          # offer the policy idle link time during decode-only steps
    temperature: float = 0.0       # default of requests without their own (0: greedy)
    seed: int = 0                  # sampling and token-id generation
    eos_token_ids: frozenset[int] = frozenset()   # stop every request unless it ignores EOS
    record_logits: bool = False    # keep the logits of every generated token (tests)
    max_running: int = 64

    def __post_init__(self):
        if self.load_rule not in LOAD_RULES:
            raise ValueError(f"load rule must be one of {', '.join(LOAD_RULES)}, got {self.load_rule!r}")


@dataclass
class EngineStats(base.EngineStats):
    """The shared counters (`pbkv.engine.base.EngineStats`) plus the real engine's own."""

    computed_tokens: int = 0                 # prompt tokens run through the model in prefill
    # tokens loaded, by source: device (unused), host, disk, shared (`pbkv.engine.request.HIT_TIERS`)
    loaded_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    load_waits: int = 0                      # requests that waited for a prefix already in flight
    recompute_instead_of_load: int = 0       # requests that recomputed a host/disk prefix
    failed_loads: int = 0                    # loads refused (corrupt or missing disk data)


@dataclass
class Output:
    """What one call produced."""

    tokens: list[int]
    hidden: np.ndarray            # final hidden state at the last prompt token (float32)
    cached_tokens: int            # prompt tokens whose KV was reused
    logits: list[torch.Tensor] = field(default_factory=list)  # per output token (record_logits)


@dataclass(eq=False)
class Seq:
    """A running request's decode state: its private KV working copy and its resolved sampling
    (`pbkv.engine.sampling`). Lives in the engine's running list from its first token until it finishes."""

    req: Request
    cache: object
    gen: torch.Generator | None
    temperature: float
    top_p: float
    stops: frozenset[int]
    limit: int                    # max new tokens
