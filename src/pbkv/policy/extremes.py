"""Per agent class, the earliest next-use time and the largest reuse probability over the
active workflows, kept under updates in O(classes * log workflows) instead of a rescan.

`NextUse` ranks common nodes by these extremes and must learn which classes' extremes moved
after each new prediction (their common nodes are re-ranked). Rescanning every workflow for a
class whenever the updated workflow had held its extreme cost O(workflows) per call, most of
pbkv's policy time at 100 lanes. Here each class keeps two heaps with lazy invalidation: an
entry (value, seq, workflow) is live while `seq` is the workflow's current stamp.

Invariant: `first[a]` == min over stored workflows of when[w][a] (inf if none) and `pmax[a]` ==
max of prob[w][a] (0 if none), over the workflows whose rows have the current class count;
`set`/`remove` return exactly the classes whose (first, pmax) value changed, ascending.
"""

from __future__ import annotations

import heapq
import math

INF = math.inf


class Extremes:
    """min `when` and max `prob` per class over workflows (rows of `n` values each)."""

    def __init__(self):
        self.first: list[float] = []
        self.pmax: list[float] = []
        self._low: list[list] = []     # per class: heap of (when, seq, workflow)
        self._high: list[list] = []    # per class: heap of (-prob, seq, workflow)
        self._stamp: dict[int, int] = {}
        self._seq = 0

    def reset(self, n: int, when: dict[int, list[float]], prob: dict[int, list[float]]) -> list[int]:
        """Rebuild for `n` classes from every workflow whose rows have n values; return the
        classes whose extremes differ from the empty ones (inf, 0)."""
        self.first, self.pmax = [INF] * n, [0.0] * n
        self._low, self._high = [[] for _ in range(n)], [[] for _ in range(n)]
        self._stamp = {}
        for w, row in when.items():
            if len(row) == n:
                self._push(w, row, prob[w])
        return self._settle(range(n))

    def set(self, workflow: int, when: list[float], prob: list[float]) -> list[int]:
        """The workflow's rows changed (same class count); return the classes that moved."""
        self._push(workflow, when, prob)
        return self._settle(range(len(self.first)))

    def remove(self, workflow: int) -> list[int]:
        if self._stamp.pop(workflow, None) is None:
            return []
        return self._settle(range(len(self.first)))

    def _push(self, w: int, when: list[float], prob: list[float]) -> None:
        self._seq += 1
        seq = self._stamp[w] = self._seq
        for a in range(len(self._low)):
            heapq.heappush(self._low[a], (when[a], seq, w))
            heapq.heappush(self._high[a], (-prob[a], seq, w))

    def _settle(self, classes) -> list[int]:
        """Drop stale tops, read each class's extremes, compact heaps that went mostly stale."""
        stamp, moved = self._stamp, []
        limit = 2 * len(stamp) + 64
        for a in classes:
            low, high = self._low[a], self._high[a]
            while low and stamp.get(low[0][2]) != low[0][1]:
                heapq.heappop(low)
            while high and stamp.get(high[0][2]) != high[0][1]:
                heapq.heappop(high)
            first = low[0][0] if low else INF
            pmax = max(0.0, -high[0][0]) if high else 0.0   # as a max starting from 0
            if first != self.first[a] or pmax != self.pmax[a]:
                moved.append(a)
            self.first[a], self.pmax[a] = first, pmax
            if len(low) > limit:
                self._low[a] = self._live(low)
                self._high[a] = self._live(high)
        return moved

    def _live(self, heap: list) -> list:
        kept = [e for e in heap if self._stamp.get(e[2]) == e[1]]
        heapq.heapify(kept)
        return kept
