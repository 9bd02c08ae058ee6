"""Per-tier heap of eviction candidates with lazy invalidation.

Each push stamps the node with a new version; an entry is valid only while its version is the
node's current one and the node is still evictable in this tier. Keys come from the policy
(smaller is evicted first) and are computed when pushed, so a policy whose values change must
ask the cache to `refresh` the affected nodes. The heap is compacted when stale entries
outnumber live nodes, which keeps pops O(log n) amortised.
"""

from __future__ import annotations

import heapq
from typing import Callable

from pbkv.cache.node import Node


class EvictIndex:
    """Candidates of one tier, ordered by `key(node)` then node id (deterministic ties)."""

    def __init__(self, key: Callable[[Node], tuple]):
        self.key = key
        self.heap: list[tuple] = []

    def push(self, node: Node) -> None:
        node.version += 1
        heapq.heappush(self.heap, (self.key(node), node.id, node.version, node))

    def pop(self, is_candidate: Callable[[Node], bool]) -> Node | None:
        """Remove and return the best valid candidate, or None when there is none."""
        heap = self.heap
        while heap:
            _, _, version, node = heapq.heappop(heap)
            if version == node.version and is_candidate(node):
                node.version += 1  # popped: any other copy of this node's entry is now stale
                return node
        return None

    def peek(self, is_candidate: Callable[[Node], bool]) -> Node | None:
        """The best valid candidate, left in place (stale entries on top are discarded)."""
        heap = self.heap
        while heap:
            _, _, version, node = heap[0]
            if version == node.version and is_candidate(node):
                return node
            heapq.heappop(heap)
        return None

    def peek_all(self, is_candidate: Callable[[Node], bool]) -> list[Node]:
        """All valid candidates in eviction order (for tests and prefetch planning; O(n log n))."""
        entries = sorted(e for e in self.heap if e[2] == e[3].version and is_candidate(e[3]))
        return [e[3] for e in entries]

    def compact(self, is_candidate: Callable[[Node], bool], live_nodes: int) -> None:
        """Drop stale entries once they dominate the heap."""
        if len(self.heap) > 2 * live_nodes + 1024:
            self.heap = [e for e in self.heap if e[2] == e[3].version and is_candidate(e[3])]
            heapq.heapify(self.heap)
