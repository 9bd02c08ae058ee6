"""Per-tier heap of eviction candidates with lazy invalidation.

Each push stamps the node with a new version; an entry is valid only while its version is the
node's current one and the node is still evictable in this tier. Keys come from the policy
(smaller is evicted first) and are computed when pushed, so a policy whose values change must
ask the cache to `refresh` the affected nodes.

Cost (why it stays flat at 100,000 nodes):
- a push whose key equals the key of the node's live entry in this index is skipped (the entry
  already sits where the new one would: the order is by key then node id); `node.indexed`
  names the index holding the node's live entry and `node.key` its key, cleared whenever that
  entry leaves;
- stale entries are compacted away when they outnumber live nodes, checked on push, so the cost
  of compaction is spread over the pushes that made them, not charged to the next eviction;
- the next FRONT entries sit in a small sorted list (`front`), taken from the heap in one go:
  an engine evicts between long stretches of other work, when the heap's pages are out of the
  CPU's caches, and one cold pop walks ~2 log n scattered entries; a batch of pops walks the
  same top of the heap while it is warm. An entry is taken from whichever of `front` and the
  heap has the smaller one, so the order is exactly the heap's.
"""

from __future__ import annotations

import heapq
from typing import Callable

from pbkv.cache.node import Node, Tier

FRONT = 32


class EvictIndex:
    """Candidates of one tier, ordered by `key(node)` then node id (deterministic ties).

    `live()`: how many nodes the tier holds (the compaction threshold)."""

    def __init__(self, key: Callable[[Node], tuple], tier: Tier, live: Callable[[], int]):
        self.key = key
        self.tier = tier
        self.live = live
        self.heap: list[tuple] = []
        self.front: list[tuple] = []   # entries taken off the heap, largest first

    def is_candidate(self, node: Node) -> bool:
        """May `node` be evicted from this tier now: alive, here, unlocked, and no child here
        (a node's children in its own tier must go first; children below it go with it)."""
        return (node.alive and node.tier == self.tier and node.lock == 0
                and node.same_tier_children == 0)

    def push(self, node: Node) -> None:
        key = self.key(node)
        if node.indexed is self and node.key == key:
            return  # its live entry already has this key
        node.version += 1
        node.indexed, node.key = self, key
        heapq.heappush(self.heap, (key, node.id, node.version, node))
        if len(self.heap) + len(self.front) > 2 * self.live() + 1024:
            self.compact()

    def pop(self) -> Node | None:
        """Remove and return the best valid candidate, or None when there is none."""
        while True:
            entry = self._first()
            if entry is None:
                return None
            self._drop_first(entry)
            node = entry[3]
            if entry[2] == node.version:
                if node.indexed is self:
                    node.indexed = node.key = None
                if self.is_candidate(node):
                    node.version += 1  # popped: any other copy of this node's entry is now stale
                    return node

    def peek(self) -> Node | None:
        """The best valid candidate, left in place (invalid entries on top are discarded)."""
        while True:
            entry = self._first()
            if entry is None:
                return None
            node = entry[3]
            if entry[2] == node.version:
                if self.is_candidate(node):
                    return node
                self._forget(node)
            self._drop_first(entry)

    def tokens_below(self, floor: tuple, enough: int) -> int:
        """Tokens of the candidates keyed below `floor`, counted in eviction order, stopping
        once `enough` is reached (the cost is what a load would evict, not the tier's size).

        When this is >= the tokens to free, evicting them takes only nodes keyed below
        `floor`: each eviction pops the smallest candidate, and while a counted candidate is
        left the smallest is keyed no higher than it (a parent that an eviction exposes is
        popped only when it is the smallest)."""
        total = 0
        for entry in heapq.merge(reversed(self.front), self._heap_in_order()):
            if not entry[0] < floor:
                break
            node = entry[3]
            if entry[2] == node.version and self.is_candidate(node):
                total += node.tokens
                if total >= enough:
                    break
        return total

    def _heap_in_order(self):
        """The heap's entries, smallest first, without popping: a walk of its tree by a frontier
        heap (O(k log k) for the k smallest)."""
        heap = self.heap
        if not heap:
            return
        frontier = [(heap[0], 0)]
        while frontier:
            entry, i = heapq.heappop(frontier)
            yield entry
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(heap):
                    heapq.heappush(frontier, (heap[j], j))

    def peek_all(self) -> list[Node]:
        """All valid candidates in eviction order (for tests and prefetch planning; O(n log n))."""
        entries = sorted(e for e in self.heap + self.front if e[2] == e[3].version and self.is_candidate(e[3]))
        return [e[3] for e in entries]

    def compact(self) -> None:
        """Drop every stale entry and every entry of a node that is no longer a candidate (a
        node that becomes one again is refreshed by the cache, so it is pushed anew)."""
        self.heap = self._valid(self.heap)
        heapq.heapify(self.heap)
        self.front = self._valid(self.front)   # a subsequence of a sorted list stays sorted

    def _valid(self, entries: list[tuple]) -> list[tuple]:
        kept = []
        for entry in entries:
            node = entry[3]
            if entry[2] == node.version:
                if self.is_candidate(node):
                    kept.append(entry)
                else:
                    self._forget(node)
        return kept

    def _first(self) -> tuple | None:
        """The smallest entry of `front` and the heap (refilling `front` when empty)."""
        front, heap = self.front, self.heap
        if not front:
            self._refill()
        if front and (not heap or front[-1] < heap[0]):
            return front[-1]
        return heap[0] if heap else None

    def _drop_first(self, entry: tuple) -> None:
        """Remove `entry`, which `_first` just returned."""
        if self.front and self.front[-1] is entry:
            self.front.pop()
        else:
            heapq.heappop(self.heap)

    def _refill(self) -> None:
        heap, taken = self.heap, []
        while heap and len(taken) < FRONT:
            entry = heapq.heappop(heap)
            if entry[2] == entry[3].version:  # stale ones go now
                taken.append(entry)
        taken.reverse()
        self.front.extend(taken)

    def _forget(self, node: Node) -> None:
        """The node's live entry left this index: its next push must not be skipped."""
        if node.indexed is self:
            node.indexed = node.key = None
