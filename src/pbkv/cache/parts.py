"""What `TieredCache` is built from and talks to: tier capacities, the contracts a policy
(`EvictionRules`) and a real engine's tensors (`Storage`) fulfil, a pending two-phase `Move`,
and the token counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pbkv.cache.node import Node, Tier


class EvictionRules(Protocol):
    """What the cache asks of a policy (see `pbkv.policy.base.Policy`)."""

    def priority(self, node: Node) -> tuple: ...
    def keep_on_evict(self, node: Node) -> bool: ...
    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None: ...


class Storage(Protocol):
    """Where the nodes' data lives (a real engine's KV tensors); told of every change in the tree.

    Calls happen inside the cache's own bookkeeping, on the caller's thread: `moved` after a
    node's tier changed (eviction one tier down, or a completed load up), `split` after `upper`
    was cut off the front of `lower`, `dropped` before a node leaves the tree for good."""

    def moved(self, node: Node, src: Tier, dst: Tier) -> None: ...
    def split(self, upper: Node, lower: Node) -> None: ...
    def dropped(self, node: Node) -> None: ...


@dataclass
class Capacities:
    """Tier sizes in tokens; 0 disables a tier (the device must be > 0)."""

    device: int
    host: int = 0
    disk: int = 0

    def __post_init__(self):
        if self.device <= 0:
            raise ValueError(f"device capacity must be > 0 tokens, got {self.device}")
        if self.host < 0 or self.disk < 0:
            raise ValueError(f"capacities must be >= 0, got host={self.host} disk={self.disk}")

    def of(self, tier: Tier) -> int:
        return (self.device, self.host, self.disk)[tier]


@dataclass
class Move:
    """A pending move of a contiguous path segment (root side first) into `dst`."""

    nodes: list[Node]
    src: list[Tier]
    dst: Tier
    tokens: int
    keep_lock: bool
    done: bool = False


@dataclass
class CacheStats:
    """Token counters since creation (the engine turns tokens into bytes)."""

    demoted: list[int] = field(default_factory=lambda: [0, 0, 0])   # tokens moved down, by source tier
    dropped: list[int] = field(default_factory=lambda: [0, 0, 0])   # tokens dropped, by tier
    loaded: list[int] = field(default_factory=lambda: [0, 0, 0])    # tokens read up (not recomputed), by source tier
    evictions: int = 0
