"""Capacities, eviction and two-phase moves over the radix tree's three tiers.

`TieredCache` owns the token accounting of each tier and executes what an eviction policy
(anything with `priority`, `keep_on_evict`, `on_evict`) ranks; it holds no policy logic itself.

Invariants (checked by `check`):
- `usage[t]` == tokens of nodes in tier t (+ reservations and pending loads for the device);
  `usage[t]` <= `capacity[t]` after every public call;
- only unlocked nodes with no child in their own tier are evicted (leaves per tier);
- `evict(tier, n)` is atomic: it frees at least n tokens, or changes nothing and returns False;
- an evicted node moves one tier down when the policy keeps it and that tier can make room,
  otherwise it is dropped together with its subtree (whose KV is useless without the prefix);
- a move is two-phase: `prepare_load` reserves space and pins the path, `complete` switches
  tiers; between the two the nodes are readable in their source tier and cannot be evicted;
- when a `Storage` is attached (a real engine's KV tensors), it hears of every tier change,
  split and removal at the moment the tree records it, so a node's data always sits in the
  node's tier (the simulator attaches none).
"""

from __future__ import annotations

from pbkv.cache.evict_index import EvictIndex
from pbkv.cache.node import Node, Tier
from pbkv.cache.parts import Capacities, CacheStats, EvictionRules, Move, Storage
from pbkv.cache.tree import RadixTree, TreeError

TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
__all__ = ["TieredCache", "Capacities", "CacheStats", "EvictionRules", "Move", "Storage"]


class TieredCache:
    """Token accounting and eviction for a `RadixTree` over device, host and disk."""

    def __init__(self, tree: RadixTree, capacities: Capacities, rules: EvictionRules,
                 storage: Storage | None = None):
        self.tree = tree
        self.storage = storage
        self.capacity = capacities
        self.rules = rules
        self.usage = [0, 0, 0]
        self.locked = [0, 0, 0]      # tokens of locked nodes, per tier
        self.nodes = [0, 0, 0]       # node count per tier
        self.reserved = 0            # device tokens held for running requests (outputs, inserts)
        self.stats = CacheStats()
        self.index = [EvictIndex(rules.priority, t, self._count_in(t)) for t in TIERS]
        tree.on_lock_change = self._lock_changed
        tree.on_split = self._split

    # ------------------------------------------------------------------ queries

    def free(self, tier: Tier) -> int:
        return self.capacity.of(tier) - self.usage[tier]

    def evictable(self, tier: Tier) -> int:
        """Tokens that eviction could free in `tier` (everything neither locked nor reserved)."""
        pinned = self.locked[tier] + (self.reserved if tier == Tier.DEVICE else 0)
        return self.usage[tier] - pinned

    def is_candidate(self, node: Node, tier: Tier) -> bool:
        return self.index[tier].is_candidate(node)

    def _count_in(self, tier: Tier):
        return lambda: self.nodes[tier]

    def next_victim(self, tier: Tier) -> Node | None:
        """The node `evict(tier, ...)` would take first now, or None (an admission check:
        is a node worth more than what writing it into `tier` would push out?)."""
        return self.index[tier].peek()

    def candidates(self, tier: Tier) -> list[Node]:
        """Current eviction order of `tier` (slow: for tests, prefetch planning and reports)."""
        return self.index[tier].peek_all()

    # ------------------------------------------------------------------ space

    def make_room(self, tier: Tier, tokens: int, floor: tuple | None = None) -> bool:
        """Ensure `tokens` free tokens in `tier`, evicting if needed. Atomic. With a `floor`
        (an eviction key), only nodes keyed below it may go: a load ahead of use must not push
        out what the policy ranks above the node it loads."""
        if floor is not None and not self._room_below(tier, tokens, floor):
            return False
        short = tokens - self.free(tier)
        return short <= 0 or self.evict(tier, short)

    def _room_below(self, tier: Tier, tokens: int, floor: tuple) -> bool:
        """Free space plus the candidates keyed below `floor` cover `tokens`."""
        short = tokens - self.free(tier)
        return short <= 0 or self.index[tier].tokens_below(floor, short) >= short

    def evict(self, tier: Tier, tokens: int) -> bool:
        """Free at least `tokens` tokens of `tier` in the policy's order, or do nothing."""
        if tokens > self.evictable(tier):
            return False
        freed = 0
        index = self.index[tier]
        while freed < tokens:
            node = index.pop()
            if node is None:  # cannot happen while the counters are right
                raise TreeError(f"{tier.name}: {self.evictable(tier)} tokens evictable but no candidate")
            freed += node.tokens
            self._evict_node(node)
        return True

    def reserve(self, tokens: int) -> bool:
        """Hold device space outside the tree (a running request's new tokens). Atomic."""
        if not self.make_room(Tier.DEVICE, tokens):
            return False
        self.reserved += tokens
        self.usage[Tier.DEVICE] += tokens
        return True

    def release(self, tokens: int) -> None:
        if tokens > self.reserved:
            raise TreeError(f"release of {tokens} tokens but only {self.reserved} reserved")
        self.reserved -= tokens
        self.usage[Tier.DEVICE] -= tokens

    # ------------------------------------------------------------------ tree updates

    def insert(self, hash_ids: list[int], tail_tokens: int, now: float) -> tuple[Node, int]:
        """Insert a prompt's missing blocks on the device, paid from reserved space.

        Returns (deepest node, tokens added). The caller reserved at least the added tokens."""
        node, new = self.tree.insert(hash_ids, tail_tokens, Tier.DEVICE, now)
        added = sum(n.tokens for n in new)
        if added > self.reserved:
            raise TreeError(f"insert of {added} tokens exceeds the {self.reserved} reserved")
        self.reserved -= added  # the space stays used, now by tree nodes
        for n in new:
            self.nodes[Tier.DEVICE] += 1
            if n.lock:
                self.locked[Tier.DEVICE] += n.tokens
            self.refresh(n)
        return node, added

    def replace_rules(self, rules: EvictionRules) -> None:
        """Rank by `rules` from now on: every candidate of every tier is keyed again."""
        self.rules = rules
        for index in self.index:
            index.key = rules.priority
            for node in index.peek_all():
                index.push(node)

    def refresh(self, node: Node) -> None:
        """Re-rank `node` after anything its priority depends on changed."""
        index = self.index[node.tier]
        if index.is_candidate(node):
            index.push(node)

    def end_workflow(self, workflow: int) -> list[Node]:
        """Forget a finished workflow's tags and re-rank the nodes it touched."""
        nodes = self.tree.end_workflow(workflow)
        for node in nodes:
            self.refresh(node)
        return nodes

    # ------------------------------------------------------------------ moves

    def prepare_load(self, nodes: list[Node], dst: Tier = Tier.DEVICE, keep_lock: bool = True,
                     allow_evict: bool = True, floor: tuple | None = None) -> Move | None:
        """Phase one of moving a path segment up into `dst`: reserve space and pin the path.

        `nodes` run root side first; the first one's parent must already be in `dst` or faster.
        Room is made by evicting (when `allow_evict`) only nodes keyed below `floor`, when
        given (`make_room`). Returns None (and changes nothing) when `dst` cannot make room."""
        if not nodes:
            return None
        if nodes[0].parent.tier > dst:
            raise TreeError(f"cannot load {nodes[0]} above its parent {nodes[0].parent}")
        tokens = sum(n.tokens for n in nodes)
        if allow_evict and floor is not None and not self._room_below(dst, tokens, floor):
            # decided before pinning: a pin and unpin re-key the whole path, and a load waiting
            # for room is offered again at every decode round (pinning only takes candidates away)
            return None
        deepest = nodes[-1]
        self.tree.lock(deepest)  # pin first: making room must not evict what we load
        room = self.make_room(dst, tokens, floor) if allow_evict else self.free(dst) >= tokens
        if not room:
            self.tree.unlock(deepest)
            return None
        self.usage[dst] += tokens
        if dst == Tier.DEVICE:
            self.reserved += tokens  # pending: counted as used, not evictable
        return Move(nodes, [n.tier for n in nodes], dst, tokens, keep_lock)

    def complete(self, move: Move, loaded: bool = True) -> None:
        """Phase two: the data has arrived; the nodes now live in `move.dst`.

        `loaded=False`: the data was not read from the source tiers but recomputed (a real
        engine's promotion of a recomputed prefix); the move is not counted in `stats.loaded`."""
        if move.done:
            raise TreeError("move completed twice")
        move.done = True
        dst = move.dst
        self.usage[dst] -= move.tokens
        if dst == Tier.DEVICE:
            self.reserved -= move.tokens
        for node, src in zip(move.nodes, move.src):
            self._set_tier(node, dst)
            if loaded:
                self.stats.loaded[src] += node.tokens
        if not move.keep_lock:
            self.tree.unlock(move.nodes[-1])

    def abort(self, move: Move) -> None:
        """Give up a prepared move: release its space and its pin."""
        move.done = True
        self.usage[move.dst] -= move.tokens
        if move.dst == Tier.DEVICE:
            self.reserved -= move.tokens
        self.tree.unlock(move.nodes[-1])

    @staticmethod
    def below_device(node: Node) -> list[Node]:
        """The path segment that is not on the device, root side first: what loading `node`
        onto the device moves (empty when `node` is on the device). `node` must be in the tree."""
        if not node.alive:
            raise TreeError(f"{node} is not in the tree (dropped): it has no path to load")
        segment = []
        while node.tier != Tier.DEVICE:
            segment.append(node)
            node = node.parent
        segment.reverse()
        return segment

    def discard(self, node: Node) -> bool:
        """Drop `node` and its subtree now (their data is lost, e.g. a corrupt disk file).

        Returns False and changes nothing while the node is locked (a lock covers its subtree's
        locks, so an unlocked node has an unlocked subtree)."""
        if not node.alive or node is self.tree.root:
            return True
        if node.lock:
            return False
        src = node.tier
        self._drop(node)
        self.rules.on_evict(node, src, None)
        return True

    # ------------------------------------------------------------------ internals

    def _split(self, upper: Node) -> None:
        self.nodes[upper.tier] += 1
        lower = next(iter(upper.children.values()))   # right after a split: the node it was cut from
        if self.storage is not None:
            self.storage.split(upper, lower)
        self.refresh(lower)   # its first block and size changed: a key from before ranks the old content

    def _lock_changed(self, node: Node, delta: int) -> None:
        self.locked[node.tier] += delta * node.tokens
        if delta < 0:
            self.refresh(node)

    def _set_tier(self, node: Node, dst: Tier) -> None:
        """Move `node` to `dst`, keeping usage, lock counters and same-tier child counts exact."""
        src = node.tier
        parent = node.parent
        self.usage[src] -= node.tokens
        self.usage[dst] += node.tokens
        self.nodes[src] -= 1
        self.nodes[dst] += 1
        if node.lock:
            self.locked[src] -= node.tokens
            self.locked[dst] += node.tokens
        if parent.tier == src:
            parent.same_tier_children -= 1
            if parent.same_tier_children == 0:
                self.refresh(parent)
        node.tier = dst
        if parent.tier == dst:
            parent.same_tier_children += 1
        node.same_tier_children = sum(1 for c in node.children.values() if c.tier == dst)
        if self.storage is not None:
            self.storage.moved(node, src, dst)
        self.refresh(node)

    def _evict_node(self, node: Node) -> None:
        src = node.tier
        self.stats.evictions += 1
        dst = TIERS[src + 1] if src < Tier.DISK else None
        if dst is not None and not (self.capacity.of(dst) > 0 and self.rules.keep_on_evict(node)
                                    and self.make_room(dst, node.tokens)):
            dst = None
        if dst is None:
            self._drop(node)
        else:
            self.stats.demoted[src] += node.tokens
            self._set_tier(node, dst)
        self.rules.on_evict(node, src, dst)

    def _drop(self, node: Node) -> None:
        """Remove `node` and its subtree (all in slower tiers, all unlocked)."""
        parent = node.parent
        stack = [node]
        order = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            self.usage[n.tier] -= n.tokens
            self.nodes[n.tier] -= 1
            self.stats.dropped[n.tier] += n.tokens
            if self.storage is not None:
                self.storage.dropped(n)
            self.tree.remove(n)
        if parent is not self.tree.root and parent.same_tier_children == 0:
            self.refresh(parent)

    def check(self) -> None:
        """Assert the accounting invariants (slow; for tests)."""
        self.tree.check()
        usage, locked, count = [0, 0, 0], [0, 0, 0], [0, 0, 0]
        for n in self.tree.iter_nodes():
            usage[n.tier] += n.tokens
            count[n.tier] += 1
            if n.lock:
                locked[n.tier] += n.tokens
        assert self.reserved >= 0
        assert usage[Tier.DEVICE] + self.reserved == self.usage[Tier.DEVICE], (usage, self.usage, self.reserved)
        for t in (Tier.HOST, Tier.DISK):
            assert usage[t] <= self.usage[t], (t, usage, self.usage)  # pending loads into host/disk
        assert locked == self.locked, (locked, self.locked)
        assert count == self.nodes, (count, self.nodes)
        for t in TIERS:
            assert self.usage[t] <= self.capacity.of(t), (t, self.usage, self.capacity)
