"""A radix-tree node: a run of consecutive token blocks stored in one tier.

Invariants (checked by `RadixTree.check`):
- `tokens` == block_size * len(blocks) - (block_size - tail_tokens); only a node's last block may
  be partial, and a node whose last block is partial has no children;
- a child is never in a faster tier than its parent (tier order DEVICE < HOST < DISK);
- `lock` >= 0, and a locked node's ancestors are locked at least as often (locks cover paths);
- `same_tier_children` == number of children whose tier equals this node's tier;
- tags only ever grow with accesses, so a node's tags contain every tag of its descendants:
  a shared prefix is worth at least its best descendant for any score that grows with tags.
"""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Storage tiers, fastest first."""

    DEVICE = 0
    HOST = 1
    DISK = 2


class Node:
    """One node of the radix tree. Plain data; the tree and the cache manager maintain it."""

    __slots__ = ("id", "blocks", "start", "tokens", "tail_tokens", "parent", "children", "tier",
                 "lock", "same_tier_children", "last_access", "hits", "wf_agents", "agent_mask",
                 "seen_workflows", "version", "indexed", "key", "policy_data", "alive", "value")

    def __init__(self, node_id: int, blocks: list[int], start: int, tokens: int, tail_tokens: int,
                 parent: Node | None, tier: Tier, now: float):
        self.id = node_id
        self.blocks = blocks          # block ids, in prompt order
        self.start = start            # position of blocks[0] in every prompt that contains it
        self.tokens = tokens          # size in tokens
        self.tail_tokens = tail_tokens  # tokens in the last block (block_size unless partial)
        self.parent = parent
        self.children: dict[int, Node] = {}  # first block id -> child
        self.tier = tier
        self.lock = 0                 # in-use count: never evicted while > 0
        self.same_tier_children = 0
        self.last_access = now
        self.hits = 0
        self.wf_agents: dict[int, int] = {}  # active workflow -> bitmask of its agents that used this node
        self.agent_mask = 0           # every agent that ever used this node (bitmask)
        self.seen_workflows = 0       # distinct workflows that ever used this node
        self.version = 0              # bumps on every eviction-index push (stale heap entries skip)
        self.indexed = None           # the EvictIndex holding this node's live entry, if any
        self.key = None               # that entry's key
        self.policy_data = None       # free slot for the active policy's per-node state
        self.alive = True             # False once removed from the tree
        self.value = None             # engine payload (real KV tensors); None in the simulator

    @property
    def last_block(self) -> int:
        return self.blocks[-1]

    @property
    def end(self) -> int:
        """Position one past this node's last block."""
        return self.start + len(self.blocks)

    @property
    def retired(self) -> bool:
        """True when workflows used this node and every one of them has ended."""
        return self.seen_workflows > 0 and not self.wf_agents

    def path(self) -> list[Node]:
        """Nodes from the first below the root down to this one."""
        out = []
        node = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (f"Node(id={self.id}, blocks={self.blocks[0]}..{self.blocks[-1]}#{len(self.blocks)}, "
                f"tokens={self.tokens}, tier={self.tier.name}, lock={self.lock})")
