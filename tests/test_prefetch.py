"""The shared prefetch-preparation loop (engine/prefetch.py) against a tree that changes under it."""

from __future__ import annotations

import pytest

from helpers import make_cache, put
from pbkv.cache import Tier
from pbkv.cache.tree import TreeError
from pbkv.engine.prefetch import prepare_prefetches


def _two_on_host():
    """Device and host hold two one-block nodes each; x and y (older) sit on the host."""
    cache, _ = make_cache(device=8, host=8)
    x = put(cache, "x", 0)
    y = put(cache, "y", 1)
    put(cache, "p", 2)
    put(cache, "q", 3)
    assert (x.tier, y.tier) == (Tier.HOST, Tier.HOST)
    return cache, x, y


def test_a_candidate_dropped_by_an_earlier_prefetch_is_skipped():
    # loading x evicts p from the device to the host, which drops y (no disk tier):
    # y was wanted by the same plan and must be skipped, not walked up a detached path
    cache, x, y = _two_on_host()
    moves = list(prepare_prefetches(cache, [x, y], 100, True, lambda n: False))
    assert [m.nodes for m, _ in moves] == [[x]]
    assert not y.alive
    for move, _ in moves:
        cache.complete(move)
    cache.check()
    assert x.tier == Tier.DEVICE


def test_below_device_of_a_removed_node_is_a_tree_error():
    cache, x, y = _two_on_host()
    assert cache.discard(y)
    with pytest.raises(TreeError, match="not in the tree"):
        cache.below_device(y)
