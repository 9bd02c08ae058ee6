"""What the connector's worker does in one step (`Plan`), the tree `Storage` that writes it
(`PlanOps`), and the connector's token counters (`Stats`). Imports no vLLM.

Invariant: every tier change pbkv's tree records for the shadow becomes one worker op, in the
order the tree made them (`moves`: ("disk"|"host"|"drop", key)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pbkv.cache import Node, Tier


@dataclass
class Plan:
    """What the worker does in one step. Keys are ints; block ids index vLLM's paged cache."""

    moves: list[tuple[str, int]] = field(default_factory=list)   # ("disk"|"host"|"drop", key)
    loads: list[tuple[int, int]] = field(default_factory=list)   # (key, block id), before the forward
    saves: list[tuple[int, int]] = field(default_factory=list)   # (key, block id), after the forward
    shared_loads: list[tuple[bytes, int]] = field(default_factory=list)   # (full block hash, block id)
    shared_saves: list[tuple[bytes, int]] = field(default_factory=list)   # (full block hash, block id)
    # block ids of every scheduled request that uses a block loaded this step (empty without
    # loads): a failed load taints the blocks after it in each chain holding it (`tainted`)
    chains: list[list[int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.moves or self.loads or self.saves or self.shared_loads or self.shared_saves)


@dataclass
class Stats:
    """Counters since start: prompt tokens by where their KV came from, and policy fallbacks."""

    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0      # vLLM's own prefix cache
    host_hit_tokens: int = 0     # loaded from the connector's RAM
    disk_hit_tokens: int = 0     # loaded from the connector's disk files
    shared_hit_tokens: int = 0   # loaded from the directory shared with other instances
    saved_tokens: int = 0
    gpu_demoted_blocks: int = 0  # blocks moved to the head of vLLM's free queue (gpu_pool.py)
    policy_fallbacks: int = 0    # policies replaced by LRU after a hook raised (shadow.Shadow._hook)
    load_failed_blocks: int = 0  # planned loads that failed; the hit counters above then count
                                 # only what was served: a failed load and every later load of its
                                 # request are recomputed by vLLM (in computed_tokens)

    @property
    def computed_tokens(self) -> int:
        return (self.prompt_tokens - self.gpu_hit_tokens - self.host_hit_tokens - self.disk_hit_tokens
                - self.shared_hit_tokens)


def tainted(chains: list[list[int]], failed: set[int]) -> set[int]:
    """The block ids whose content is wrong after the loads of `failed` block ids failed: in each
    chain holding a failed block, that block and every block after it (they attended to it).
    Invariant: a tainted block is never saved anywhere; vLLM recomputes it."""
    bad: set[int] = set()
    if not failed:
        return bad
    for chain in chains:
        first = next((i for i, b in enumerate(chain) if b in failed), None)
        if first is not None:
            bad.update(chain[first:])
    return bad


class PlanOps:
    """The tree's `Storage`: turns tier changes into worker ops."""

    def __init__(self, plan_of):
        self.plan_of = plan_of
        self.on_device_evict = None    # callable(keys) for blocks leaving pbkv's DEVICE tier
        self.on_drop = None            # callable(keys) for blocks leaving the tree

    def moved(self, node: Node, src: Tier, dst: Tier) -> None:
        if dst == Tier.DISK:
            self.plan_of().moves.extend(("disk", k) for k in node.blocks)
        elif src == Tier.DISK:   # loads read RAM or disk, but DEVICE/HOST nodes live in RAM
            self.plan_of().moves.extend(("host", k) for k in node.blocks)
        if src == Tier.DEVICE and self.on_device_evict is not None:
            self.on_device_evict(node.blocks)

    def split(self, upper: Node, lower: Node) -> None:
        pass   # data is kept per block: a split changes nothing on the worker

    def dropped(self, node: Node) -> None:
        if node.tier == Tier.DEVICE and self.on_device_evict is not None:
            self.on_device_evict(node.blocks)
        self.plan_of().moves.extend(("drop", k) for k in node.blocks)
        if self.on_drop is not None:
            self.on_drop(node.blocks)
