"""The router interface: which replica runs a call, and whether KV moves with it.

A router is a small class behind `pbkv.route.registry`. It sees each replica only through the
`ReplicaView` protocol (an id, a load, how much of a prompt it caches, how much of a workflow's
private KV it holds), so the same class decides for the simulator's instances and for Ray
Serve replicas (whose views are built from their `routing_stats`).

Invariants every router keeps:
- `choose` returns a `RouteDecision` whose `replica` is the id of one of the views it was given;
- `fetch_from`, when set, names a different replica that holds a longer cached prefix of the
  prompt than the chosen one, and `fetch_tokens` > 0 is how many tokens to move from it;
- with equal scores the replica holding fewer workflows wins, then the earlier view in the
  given order (callers pass a stable order), so every decision is deterministic.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


class NoReplicas(RuntimeError):
    """A router was asked to choose among zero replicas."""


class BadDecision(ValueError):
    """A router's `RouteDecision` broke the interface's invariants (see `check_decision`)."""


@runtime_checkable
class ReplicaView(Protocol):
    """What a router may know about one replica (an engine instance)."""

    @property
    def id(self) -> str: ...

    @property
    def load(self) -> float:
        """Requests queued or running on the replica."""

    def cached_prefix_tokens(self, hash_ids: Sequence[int]) -> int:
        """Tokens of the longest prefix of a prompt (chained block ids) the replica caches, any tier."""

    def workflow_tokens(self, workflow_id: str) -> int:
        """Tokens of KV the replica holds that this workflow touched (0: it holds none)."""

    @property
    def workflow_count(self) -> int:
        """Workflows the replica holds KV of (spreads new workflows when all else is equal)."""


@dataclass(frozen=True)
class RouteRequest:
    """One call to place. `reuse_probability` is a predictor's estimate that the KV this call
    leaves behind is read again by the workflow (None: unknown, treated as 1); `next_prefix`
    is the predicted next agent's prompt prefix (chained block ids), to warm ahead of time."""

    workflow_id: str
    agent: str
    hash_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int = 0
    reuse_probability: float | None = None
    next_prefix: tuple[int, ...] = ()

    def __post_init__(self):
        # a hint from a client must never make a router raise or mis-weigh: anything that is not
        # a probability counts as unknown, so the replica's reported estimate can take its place
        object.__setattr__(self, "reuse_probability", reuse_hint(self.reuse_probability))


def reuse_hint(p) -> float | None:
    """`p` when it is a real number in [0, 1], else None (unknown). Bools, strings, NaN, the
    infinities and values outside [0, 1] are all unknown; valid values are returned unchanged."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        return None
    return p if 0.0 <= p <= 1.0 else None    # NaN fails both comparisons


@dataclass(frozen=True)
class RouteDecision:
    """Where a call runs. `fetch_from`/`fetch_tokens`: move this many tokens of the prompt's
    prefix from that replica first (instead of recomputing them); `warm`: block ids of the
    predicted next prompt to load on `replica` ahead of the next call."""

    replica: str
    fetch_from: str | None = None
    fetch_tokens: int = 0
    warm: tuple[int, ...] = ()
    reason: str = ""


@dataclass
class RouterConfig:
    """Costs a router weighs, in seconds (defaults: a mid-size model on one GPU; the simulator
    fills them from its profile). `load_penalty_tokens` is the prefix router's exchange rate:
    one queued request costs as much as this many uncached prompt tokens. `can_fetch` False:
    replicas cannot move KV between them (every transfer costs infinitely much)."""

    prefill_s_per_token: float = 1e-4
    transfer_s_per_token: float = 2e-6
    transfer_latency_s: float = 1e-3
    queue_s_per_request: float = 0.5
    load_penalty_tokens: int = 512
    block_size: int = 16
    can_fetch: bool = True
    extra: dict = field(default_factory=dict)

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.transfer_latency_s + tokens * self.transfer_s_per_token if self.can_fetch else math.inf


class Router(ABC):
    """Base class: subclasses implement `choose`; `on_workflow_end` lets stateful routers forget."""

    name = "base"

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()

    @abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        """Where `request` goes among `replicas` (at least one)."""

    def on_workflow_end(self, workflow_id: str) -> None:
        pass


def router_label(router: Router) -> str:
    """How errors name a router: the `name` its own class sets, else `module:Class` (an
    out-of-tree router that inherits `name` would otherwise pass for its base class)."""
    cls = type(router)
    own = cls.__dict__.get("name")
    return own if isinstance(own, str) else f"{cls.__module__}:{cls.__qualname__}"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_decision(router: Router, decision, request: RouteRequest, replicas: Sequence[ReplicaView]) -> None:
    """Refuse a decision that breaks the invariants above, before anyone acts on it: `replica`
    is the id of one of `replicas`; `fetch_from` is None or the id of another one; `fetch_tokens`
    is an int in [0, the prompt's tokens] (0 with `fetch_from`: nothing moves), 0 without it;
    `warm` is a tuple or list of int block ids. Raises `BadDecision` naming the router, the
    field and the value. Every built-in router's decisions pass (tests/test_route.py)."""
    who = f"router {router_label(router)}"
    if not isinstance(decision, RouteDecision):
        raise BadDecision(f"{who}: choose returned {decision!r}, not a RouteDecision")
    ids = [v.id for v in replicas]
    known = ", ".join(map(repr, ids[:8])) + (", ..." if len(ids) > 8 else "")
    if decision.replica not in ids:
        raise BadDecision(f"{who}: replica {decision.replica!r} is not one of the replicas it was given ({known})")
    if decision.fetch_from is not None and decision.fetch_from not in ids:
        raise BadDecision(f"{who}: fetch_from {decision.fetch_from!r} is not one of the replicas it was given ({known})")
    if decision.fetch_from == decision.replica:
        raise BadDecision(f"{who}: fetch_from {decision.fetch_from!r} is the chosen replica itself")
    tokens = decision.fetch_tokens
    if not _is_int(tokens) or not 0 <= tokens <= request.input_tokens:
        raise BadDecision(f"{who}: fetch_tokens {tokens!r} is not an int in [0, {request.input_tokens}] "
                          f"(the prompt's tokens)")
    if tokens and decision.fetch_from is None:
        raise BadDecision(f"{who}: fetch_tokens {tokens!r} without fetch_from (no replica to fetch from)")
    if not isinstance(decision.warm, (tuple, list)) or not all(_is_int(h) for h in decision.warm):
        raise BadDecision(f"{who}: warm {decision.warm!r} is not a tuple of int block ids")


def require(replicas: Sequence[ReplicaView]) -> None:
    if not replicas:
        raise NoReplicas("no replicas to route to")


def argmin(replicas: Sequence[ReplicaView], key) -> ReplicaView:
    """The replica with the smallest `key(view)`; ties go to the one holding fewer workflows,
    then to the earliest in `replicas`."""
    require(replicas)
    return min(enumerate(replicas), key=lambda iv: (key(iv[1]), iv[1].workflow_count, iv[0]))[1]


def home(request: RouteRequest, replicas: Sequence[ReplicaView]) -> tuple[ReplicaView | None, int]:
    """The replica holding most of the request's workflow's KV (the earliest of equals) and how
    many tokens it holds; (None, 0) when no replica holds any."""
    best, most = None, 0
    for v in replicas:
        t = v.workflow_tokens(request.workflow_id)
        if t > most:
            best, most = v, t
    return best, most


def cached(view: ReplicaView, request: RouteRequest) -> int:
    """Reusable prompt tokens on `view` (a prompt's last token is always computed, as engines do)."""
    return max(0, min(view.cached_prefix_tokens(request.hash_ids), request.input_tokens - 1))
