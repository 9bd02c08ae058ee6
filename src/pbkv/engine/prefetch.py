"""Turning a policy's prefetch choices into prepared host->device moves; shared by both engines."""

from __future__ import annotations

from typing import Callable, Iterator

from pbkv.cache import Move, Node, Tier, TieredCache


def prepare_prefetches(cache: TieredCache, wanted: list[Node], budget: int, allow_evict: bool,
                       busy: Callable[[Node], bool],
                       floor: Callable[[Node], tuple | None] | None = None) -> Iterator[tuple[Move, int]]:
    """Yield (prepared move, tokens) for each wanted node whose off-device segment fits what is
    left of `budget` and has no node locked or `busy` (in flight, lost); the caller starts each
    transfer. Nodes that cannot get room are skipped; the budget only pays for prepared moves.
    `floor(node)` (the policy's `prefetch_floor`): the eviction key below which room may be
    made for that node (None: any resident node, in the policy's order).

    `wanted` was planned before any move: making room for one move may demote or drop a later
    wanted node (a dropped node's path no longer reaches the root), so each node is re-checked
    here, when its turn comes, and a dropped one is skipped."""
    for node in wanted:
        if budget <= 0:
            return
        if not node.alive:  # dropped while an earlier prefetch made room (its host copy was evicted)
            continue
        if not allow_evict and node.tokens > cache.free(Tier.DEVICE):  # its segment cannot fit
            continue
        segment = cache.below_device(node)
        tokens = sum(n.tokens for n in segment)
        if not segment or tokens > budget or any(n.lock or busy(n) for n in segment):
            continue
        if not allow_evict and tokens > cache.free(Tier.DEVICE):  # cannot fit: skip the pin/unpin
            continue
        move = cache.prepare_load(segment, keep_lock=False, allow_evict=allow_evict,
                                  floor=floor(node) if floor is not None and allow_evict else None)
        if move is None:
            continue
        budget -= tokens
        yield move, tokens
