"""The replayed trace's future, for the oracle: when is a cache node next used?

Under concurrency the true next-use time depends on the policy being measured, so the oracle
uses a nominal schedule fixed before the run: closed-loop lanes take workflows in trace order,
and each call is issued after the previous one's nominal duration plus its tool wait (open
loop: workflows start at their trace `t`). Each call then has a nominal time `v`.

A runtime tree node always starts where some prompt of the trace diverges or ends, so the
nodes of a radix tree built over *all* prompts of the trace cover every runtime node's first
block. For each such node we keep the nominal times of the calls that pass through it, in
order, and a cursor past the calls already started: `next_use(block)` is amortised O(1).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

from pbkv.cache import RadixTree, Tier
from pbkv.trace import Call

INF = math.inf


def nominal_schedule(workflows: list[list[Call]], concurrency: int | None,
                     duration: Callable[[Call], float]) -> dict[tuple[str, int], float]:
    """(workflow_id, step) -> nominal issue time. `concurrency` None means open loop by `t`."""
    lanes = [0.0] * (concurrency or 1)
    times: dict[tuple[str, int], float] = {}
    for calls in workflows:
        if concurrency:
            start = heapq.heappop(lanes)
        else:
            start = calls[0].t or 0.0
        now = start
        for call in calls:
            now += call.tool_wait or 0.0
            times[(call.workflow_id, call.step)] = now
            now += duration(call)
        if concurrency:
            heapq.heappush(lanes, now)
    return times


class Future:
    """Next-use lookups over a trace's nominal schedule."""

    def __init__(self, workflows: list[list[Call]], block_size: int, concurrency: int | None,
                 duration: Callable[[Call], float]):
        times = nominal_schedule(workflows, concurrency, duration)
        tree = RadixTree(block_size)
        for calls in workflows:
            for call in calls:
                tree.insert(call.hash_ids, call.block_tokens(block_size)[-1], Tier.DEVICE, 0.0)
        uses: dict[int, list[tuple[float, str, int]]] = {}
        for calls in workflows:
            for call in calls:
                node, _ = tree.match(call.hash_ids)
                v = times[(call.workflow_id, call.step)]
                while node is not tree.root:
                    uses.setdefault(node.blocks[0], []).append((v, call.workflow_id, call.step))
                    node = node.parent
        for lst in uses.values():
            lst.sort()
        self.uses = uses
        self.cursor: dict[int, int] = {}
        self.started: set[tuple[str, int]] = set()
        self.times = times

    def mark_started(self, workflow_id: str, step: int) -> None:
        self.started.add((workflow_id, step))

    def next_use(self, first_block: int) -> float:
        """Nominal time of the earliest not-yet-started call through the node starting here."""
        lst = self.uses.get(first_block)
        if lst is None:
            return INF
        i = self.cursor.get(first_block, 0)
        started = self.started
        while i < len(lst) and (lst[i][1], lst[i][2]) in started:
            i += 1
        self.cursor[first_block] = i
        return lst[i][0] if i < len(lst) else INF
