"""ARC (adaptive replacement cache) over the radix tree's tiers.

Source: Megiddo and Modha, "ARC: a self-tuning, low overhead replacement cache" (FAST'03); the
CPU offload tier of vLLM (`vllm/v1/kv_offload/cpu/policies/`) offers it beside LRU.

ARC keeps a recency list T1 (pages used once) and a frequency list T2 (used at least twice),
ghost lists B1/B2 of recently evicted page ids, and a target size p for T1: a hit in B1 (a
recency victim wanted again) grows p, a hit in B2 shrinks it, by max(1, |B_other|/|B_this|).

Mapped onto the radix tree (which only evicts leaves, in one order per tier, by static keys):
- T1/T2 membership is the node's access count (`access.py`): 1 -> T1, >= 2 -> T2;
- instead of choosing the victim list by comparing |T1| with p at each eviction (that would
  re-rank every node whenever the choice flips), a T2 node's key is its last access plus a
  bonus `f x age`: `age` is the running mean age of this tier's victims, `f` in [0, F_MAX] plays
  the role of (c - p) / c. f = 0 is plain LRU (p = c: all recency); large f protects T2 like
  p = 0. Ghost hits move f exactly where ARC moves p (B1 hit: f down; B2 hit: f up);
- each tier has its own f, age and ghosts (ids of the evicted nodes' first blocks, bounded by
  the tier's capacity in tokens); a node demoted to a lower tier is a ghost of the tier above.
Simplified: list sizes are in tokens, counts per call; the bonus is fixed when a node is
ranked (re-ranked on its next use), so a change of f reaches nodes gradually.
"""

from __future__ import annotations

from collections import OrderedDict

from pbkv.cache import Node, Tier
from pbkv.policy import access
from pbkv.policy.base import CallEvent, Policy, PolicyContext

F_START, F_MAX, F_STEP = 0.5, 4.0, 0.05
AGE_EMA = 0.05  # weight of each new victim's age in the running mean


class _TierState:
    """ARC's adaptive state for one tier."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.f = F_START
        self.age = 0.0
        self.ghosts = (OrderedDict(), OrderedDict())   # B1, B2: first block id -> tokens
        self.ghost_tokens = [0, 0]

    def remember(self, which: int, block: int, tokens: int) -> None:
        ghosts = self.ghosts[which]
        if block in ghosts:
            self.ghost_tokens[which] -= ghosts.pop(block)
        ghosts[block] = tokens
        self.ghost_tokens[which] += tokens
        while self.ghost_tokens[which] > self.capacity and ghosts:
            self.ghost_tokens[which] -= ghosts.popitem(last=False)[1]

    def hit(self, block: int) -> bool:
        """A wanted block was a ghost: adapt f as ARC adapts p. Returns whether it was one."""
        for which in (0, 1):
            tokens = self.ghosts[which].pop(block, None)
            if tokens is not None:
                self.ghost_tokens[which] -= tokens
                mine, other = self.ghost_tokens[which] + tokens, self.ghost_tokens[1 - which]
                step = F_STEP * max(1.0, other / max(mine, 1))
                self.f = min(F_MAX, max(0.0, self.f + (step if which else -step)))
                return True
        return False


class ARCPolicy(Policy):
    name = "arc"

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.tiers: list[_TierState] = []

    def bind(self, cache, clock=None) -> None:
        super().bind(cache, clock)
        self.tiers = [_TierState(cache.capacity.of(t)) for t in Tier]

    def priority(self, node: Node) -> tuple:
        state = self.tiers[node.tier]
        bonus = state.f * state.age if access.count(node) >= 2 else 0.0
        return (node.last_access + bonus,)

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        state = self.tiers[src]
        age = max(0.0, self.clock() - node.last_access)
        state.age = age if state.age == 0.0 else (1 - AGE_EMA) * state.age + AGE_EMA * age
        state.remember(1 if access.count(node) >= 2 else 0, node.blocks[0], node.tokens)

    def on_call_start(self, event: CallEvent) -> None:
        self._ghost_hits(event)
        hash_ids = event.call.hash_ids if event.call is not None else None
        for node in access.on_hit(self.cache.tree, event.node, hash_ids):
            self.cache.refresh(node)

    def on_call_end(self, event: CallEvent) -> None:
        access.on_insert(self.cache.tree, event.node)

    def _ghost_hits(self, event: CallEvent) -> None:
        """Where the prompt leaves the device: a node below it, or the first missing block."""
        tree = self.cache.tree
        call = event.call
        if call is None:
            node, matched = event.node, None
        else:
            node, matched = tree.match(call.hash_ids)
        for n in (node.path() if node is not tree.root else []):
            if n.tier != Tier.DEVICE:
                for t in range(n.tier):  # a hit in a slower tier on blocks each faster tier evicted
                    self.tiers[t].hit(n.blocks[0])
                return
        if matched is not None and matched < len(call.hash_ids):
            for state in self.tiers:
                state.hit(call.hash_ids[matched])
