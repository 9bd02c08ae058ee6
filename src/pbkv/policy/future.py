"""The replayed trace's future, for the oracle: when will a cache node next be used?

Under concurrency the true time of a future call depends on the run itself, so it is estimated
from what is known now: a running workflow's call j is expected at the workflow's anchor (when
its last call ended) plus the nominal durations (tool waits + a rough per-call cost) of the
calls in between; a workflow not yet started is expected when its lane frees (closed loop:
workflows start in trace order, one generation of `concurrency` after another) or at its
trace `t` (open loop).

A runtime tree node always starts where some prompt of the trace diverges or ends, so the
nodes of a radix tree built over *all* prompts of the trace cover every runtime node's first
block. For each such block we keep the calls that pass through it, sorted by (workflow,
step); `next_use` scans them from a cursor past finished workflows and stops one generation
of workflows ahead, so a lookup costs O(concurrency) at most.
"""

from __future__ import annotations

import math
from typing import Callable

from pbkv.cache import RadixTree, Tier
from pbkv.trace import Call, arrival_times

INF = math.inf


class Future:
    """Next-use estimates over a trace replayed by `pbkv.driver.Replay`."""

    def __init__(self, workflows: list[list[Call]], block_size: int, concurrency: int | None,
                 duration: Callable[[Call], float]):
        self.workflows = workflows
        self.concurrency = concurrency
        self.index = {calls[0].workflow_id: i for i, calls in enumerate(workflows)}
        self.offsets: list[list[float]] = []   # per workflow: nominal issue time of each call
        self.ends: list[list[float]] = []      # per workflow: nominal end time of each call
        self.arrival = arrival_times(workflows)   # on the replay's clock (it starts at the first)
        for calls in workflows:
            now, offs, ends = 0.0, [], []
            for call in calls:
                now += call.tool_wait or 0.0
                offs.append(now)
                now += duration(call)
                ends.append(now)
            self.offsets.append(offs)
            self.ends.append(ends)
        self.lengths = [ends[-1] for ends in self.ends]
        self.mean_length = sum(self.lengths) / max(1, len(self.lengths))
        self.uses = self._index_uses(workflows, block_size)
        self.cursor: dict[int, int] = {}
        self.anchor: dict[int, float] = {}      # running workflow -> estimated start of its call 0
        self.position: dict[int, int] = {}      # running workflow -> its next call not yet ended
        self.finished: set[int] = set()
        self.next_start = 0                     # closed loop: first workflow not yet started
        self.now = 0.0

    @staticmethod
    def _index_uses(workflows: list[list[Call]], block_size: int) -> dict[int, list[tuple[int, int]]]:
        tree = RadixTree(block_size)
        for calls in workflows:
            for call in calls:
                tree.insert(call.hash_ids, call.block_tokens(block_size)[-1], Tier.DEVICE, 0.0)
        uses: dict[int, list[tuple[int, int]]] = {}
        for w, calls in enumerate(workflows):
            for call in calls:
                node, _ = tree.match(call.hash_ids)
                while node is not tree.root:
                    uses.setdefault(node.blocks[0], []).append((w, call.step))
                    node = node.parent
        for lst in uses.values():
            lst.sort()
        return uses

    # ---------------------------------------------------------------- progress

    def started(self, workflow_id: str, now: float) -> int:
        w = self.index[workflow_id]
        self.anchor[w], self.position[w], self.now = now, 0, now
        self.next_start = max(self.next_start, w + 1)
        return w

    def call_ended(self, workflow_id: str, step: int, now: float) -> int:
        """Re-anchor a workflow on what really happened: its call `step` ended now."""
        w = self.index[workflow_id]
        self.now = now
        self.position[w] = step + 1
        self.anchor[w] = now - self.ends[w][step]
        return w

    def ended(self, workflow_id: str) -> None:
        w = self.index[workflow_id]
        self.finished.add(w)
        self.anchor.pop(w, None)
        self.position.pop(w, None)

    # ---------------------------------------------------------------- lookups

    def expected(self, w: int, step: int) -> float:
        """Estimated issue time of call `step` of workflow `w`."""
        anchor = self.anchor.get(w)
        if anchor is None:
            if self.concurrency is None:
                anchor = max(self.arrival[w], self.now)
            else:
                generation = (w - self.next_start) // self.concurrency + 1
                anchor = self.now + generation * self.mean_length
        return anchor + self.offsets[w][step]

    def next_use(self, first_block: int) -> float:
        """Estimated time of the earliest call still to come through the node starting here."""
        lst = self.uses.get(first_block)
        if lst is None:
            return INF
        i = self.cursor.get(first_block, 0)
        finished = self.finished
        while i < len(lst) and lst[i][0] in finished:
            i += 1
        self.cursor[first_block] = i
        horizon = self.next_start + (self.concurrency or len(self.lengths))
        best = INF
        last_w = -1
        position = self.position
        for j in range(i, len(lst)):
            w, step = lst[j]
            if w == last_w or w in finished or step < position.get(w, 0):
                continue
            if w >= horizon:  # later generations: the first of them bounds the rest
                return min(best, self.expected(w, step))
            last_w = w  # entries are sorted: this is w's earliest remaining use
            best = min(best, self.expected(w, step))
        return best
