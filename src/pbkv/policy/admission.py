"""Admission below the device: is an evicted node worth writing one tier down?

Writing node n into tier t, when t is full, pushes t's next victim down to t+1, which pushes
t+1's victim further, and so on: only at the bottom of that cascade (the first tier with room,
or past the last tier) is anything lost. So what a write finally costs is the lowest-ranked
victim on the way down (a victim that ranks below the one pushed onto it is itself the one
rejected there), and n is written iff it outranks that, or some tier on the way has room.

Comparing with the next tier's victim alone (the earlier rule) dropped live nodes whenever
host was full of nodes ranked above them, although disk had room or held retired cache that
the host's victims would simply have displaced: every such drop was a full recompute later
(issue 11, swe with three tiers: 0.46M of 1.14M rejected tokens were recomputed).

Invariant: with free space anywhere below, a node is always kept (filling space costs nothing).
"""

from __future__ import annotations

from typing import Callable

from pbkv.cache import Node, Tier, TieredCache


def worth_writing(cache: TieredCache, node: Node, priority: Callable[[Node], tuple]) -> bool:
    """True when writing `node` (being evicted from its tier) one tier down loses nothing
    ranked above it."""
    lowest = None
    tier = node.tier + 1
    while tier <= Tier.DISK and cache.capacity.of(Tier(tier)) > 0:
        if cache.free(Tier(tier)) >= node.tokens:
            return True
        victim = cache.next_victim(Tier(tier))
        if victim is None:   # everything there is pinned: the write cannot make room anyway
            return True
        key = priority(victim)
        if lowest is None or key < lowest:
            lowest = key
        tier += 1
    return lowest is None or priority(node) > lowest
