"""Radix tree over chained token blocks: match, insert, split, lock, tags. No capacities, no policy.

Block ids are chained (docs/trace-format.md): the id at position i names the content of blocks 0..i,
so an id occurs at one position only and `index[id]` finds its node directly. Because only
nodes without children are ever removed, the blocks present in the tree are closed under
prefixes: if `hash_ids[i]` is present, so are `hash_ids[:i]`. `match` therefore binary-searches
the longest present prefix with O(log n) dictionary lookups instead of walking the tree.

Primitives:
- `match(hash_ids)`: deepest node holding a prefix of the prompt and how many blocks match;
- `insert(hash_ids, tail_tokens, tier)`: add the missing suffix (splitting a node if needed);
- `split(node, k)`: cut a node after its first k blocks (the new upper part is returned);
- `lock(node)` / `unlock(node)`: pin a whole path (nodes in use are never evicted);
- `touch(node, now, workflow, agent)`: record an access on a path (time and tags);
- `end_workflow(workflow)`: forget an ended workflow's tags (its private nodes become retired);
- `remove(node)`: delete a node without children.
Callbacks (`on_lock_change`, `on_split`) let the capacity layer keep its counters exact;
`on_remove` lets a policy's index learn of nodes leaving the tree (a dropped subtree's nodes
are removed without an eviction event each).
"""

from __future__ import annotations

from typing import Callable

from pbkv.cache.node import Node, Tier


class TreeError(RuntimeError):
    """An operation would break a tree invariant (a bug in the caller)."""


class RadixTree:
    """The mechanism: a compressed trie of block runs. See the module docstring."""

    def __init__(self, block_size: int = 16):
        self.block_size = block_size
        self.root = Node(-1, [], 0, 0, block_size, None, Tier.DEVICE, 0.0)
        self.root.lock = 1  # the root is never evicted
        self.index: dict[int, Node] = {}
        self.workflow_nodes: dict[int, dict[int, Node]] = {}  # active workflow -> nodes it touched
        self.agent_ids: dict[str, int] = {}
        self._next_id = 0
        # Hook for the capacity layer (`TieredCache`): a node became locked (+1) or unlocked (-1).
        self.on_lock_change: Callable[[Node, int], None] = lambda node, delta: None
        # Hook for the capacity layer: `split` created this new upper node (tokens unchanged).
        self.on_split: Callable[[Node], None] = lambda upper: None
        # Hook for indexes over nodes (`retired_space.py`): `remove` took this node out.
        self.on_remove: Callable[[Node], None] = lambda node: None

    # ------------------------------------------------------------------ lookup

    def __len__(self) -> int:
        return self._next_id

    def agent_bit(self, agent: str) -> int:
        """Bit of `agent` in tag masks (agents are numbered in order of first use)."""
        bit = self.agent_ids.get(agent)
        if bit is None:
            bit = self.agent_ids[agent] = len(self.agent_ids)
        return 1 << bit

    def match(self, hash_ids: list[int]) -> tuple[Node, int]:
        """Return (deepest node holding part of the longest cached prefix, matched block count).

        The returned node may hold more blocks than matched (the prompt diverges inside it)."""
        index = self.index
        lo, hi = 0, len(hash_ids)  # invariant: hash_ids[:lo] present, hash_ids[hi:] absent
        while lo < hi:
            mid = (lo + hi) // 2
            if hash_ids[mid] in index:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return self.root, 0
        return index[hash_ids[lo - 1]], lo

    def nodes_of(self, hash_ids: list[int], matched: int | None = None) -> list[Node]:
        """Nodes on the path of the matched prefix, root side first."""
        node, n = self.match(hash_ids) if matched is None else (self.index[hash_ids[matched - 1]], matched)
        return node.path() if n else []

    # ------------------------------------------------------------------ updates

    def insert(self, hash_ids: list[int], tail_tokens: int, tier: Tier, now: float) -> tuple[Node, list[Node]]:
        """Add the blocks of a prompt that are not yet present, as one new leaf in `tier`.

        `tail_tokens` is the token count of the prompt's last block. Returns (deepest node of the
        prompt, newly created nodes). The caller accounts for the capacity of new nodes."""
        node, matched = self.match(hash_ids)
        if matched and node.end > matched:
            node = self.split(node, matched - node.start)
        if matched == len(hash_ids):
            return node, []
        if node.tail_tokens != self.block_size:
            raise TreeError(f"cannot extend node {node.id}: its last block is partial")
        if tier < node.tier:
            raise TreeError(f"a {tier.name} child cannot hang below a {node.tier.name} node")
        blocks = hash_ids[matched:]
        tokens = self.block_size * (len(blocks) - 1) + tail_tokens
        leaf = Node(self._next_id, blocks, matched, tokens, tail_tokens, node, tier, now)
        self._next_id += 1
        node.children[blocks[0]] = leaf
        if tier == node.tier:
            node.same_tier_children += 1
        index = self.index
        for b in blocks:
            index[b] = leaf
        return leaf, [leaf]

    def split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k blocks; the new upper part (returned) becomes its parent.

        The upper part inherits locks, tier, access time and tags: whatever used the node used
        its first k blocks too. Handles to `node` stay valid (it keeps the deeper blocks)."""
        if not 0 < k < len(node.blocks):
            raise TreeError(f"split offset {k} outside node {node.id} of {len(node.blocks)} blocks")
        upper_tokens = k * self.block_size
        upper = Node(self._next_id, node.blocks[:k], node.start, upper_tokens, self.block_size,
                     node.parent, node.tier, node.last_access)
        self._next_id += 1
        upper.lock, upper.hits = node.lock, node.hits
        upper.wf_agents = dict(node.wf_agents)
        upper.agent_mask, upper.seen_workflows = node.agent_mask, node.seen_workflows
        node.parent.children[node.blocks[0]] = upper
        node.blocks = node.blocks[k:]
        node.start += k
        node.tokens -= upper_tokens
        node.parent = upper
        upper.children[node.blocks[0]] = node
        upper.same_tier_children = 1
        index = self.index
        for b in upper.blocks:
            index[b] = upper
        for wf in upper.wf_agents:
            self.workflow_nodes[wf][upper.id] = upper
        self.on_split(upper)
        return upper

    def remove(self, node: Node) -> None:
        """Delete a node that has no children and no locks."""
        if node.children or node.lock or node is self.root:
            raise TreeError(f"cannot remove {node}: it has children or locks")
        parent = node.parent
        del parent.children[node.blocks[0]]
        if parent.tier == node.tier:
            parent.same_tier_children -= 1
        index = self.index
        for b in node.blocks:
            del index[b]
        node.alive = False
        node.parent = None
        self.on_remove(node)

    # ------------------------------------------------------------------ locks and tags

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors (one more user)."""
        while node is not self.root:
            node.lock += 1
            if node.lock == 1:
                self.on_lock_change(node, 1)
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Release one pin on `node` and its ancestors."""
        while node is not self.root:
            if node.lock <= 0:
                raise TreeError(f"unlock of unlocked {node}")
            node.lock -= 1
            if node.lock == 0:
                self.on_lock_change(node, -1)
            node = node.parent

    def touch(self, node: Node, now: float, workflow: int | None = None, agent: str | None = None) -> list[Node]:
        """Record an access to the path ending at `node`; return the path (deepest first)."""
        bit = self.agent_bit(agent) if agent is not None else 0
        wf_nodes = self.workflow_nodes.setdefault(workflow, {}) if workflow is not None else None
        path = []
        while node is not self.root:
            node.last_access = now
            node.hits += 1
            if workflow is not None:
                mask = node.wf_agents.get(workflow)
                if mask is None:
                    node.seen_workflows += 1
                    wf_nodes[node.id] = node
                    mask = 0
                node.wf_agents[workflow] = mask | bit
            node.agent_mask |= bit
            path.append(node)
            node = node.parent
        return path

    def end_workflow(self, workflow: int) -> list[Node]:
        """Drop an ended workflow from every tag; return the live nodes it had touched."""
        nodes = self.workflow_nodes.pop(workflow, {})
        out = []
        for node in nodes.values():
            node.wf_agents.pop(workflow, None)
            if node.alive:
                out.append(node)
        return out

    # ------------------------------------------------------------------ checks

    def iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Assert every invariant of the tree (slow; for tests)."""
        count = 0
        for node in self.iter_nodes():
            count += len(node.blocks)
            parent = node.parent
            assert node.alive and parent.children[node.blocks[0]] is node
            assert node.tier >= parent.tier, f"{node} faster than its parent {parent}"
            assert node.lock >= 0 and (parent is self.root or parent.lock >= node.lock)
            assert node.tokens == self.block_size * (len(node.blocks) - 1) + node.tail_tokens
            assert node.tail_tokens == self.block_size or not node.children
            assert node.start == parent.start + len(parent.blocks) if parent is not self.root else node.start == 0
            assert node.same_tier_children == sum(c.tier == node.tier for c in node.children.values())
            for b in node.blocks:
                assert self.index[b] is node
            for child in node.children.values():
                for wf, mask in child.wf_agents.items():
                    assert node.wf_agents.get(wf, 0) & mask == mask, "tags must cover descendants"
        assert count == len(self.index)
