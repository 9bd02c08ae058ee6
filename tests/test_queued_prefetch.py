"""Loads ahead of admission: the cache's eviction floor, and pbkv loading queued calls' prefixes
(pbkv_prefetch.py) without displacing what it ranks above them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers import BLOCK, ids, make_cache, put
from pbkv.cache import Tier
from pbkv.engine.prefetch import prepare_prefetches
from pbkv.policy import CallEvent, PrefetchRequest
from test_pbkv_policy import W1, W2, arrive, call, make


def _lru_full_device():
    """LRU cache, device of 3 blocks holding a (t=1), b (t=2), c (t=3); x (t=0) on the host."""
    cache, _ = make_cache(device=3 * BLOCK, host=8 * BLOCK)
    x = put(cache, "x", 0.0)
    a, b, c = (put(cache, p, t) for p, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    assert x.tier == Tier.HOST and {a.tier, b.tier, c.tier} == {Tier.DEVICE}
    return cache, x, a, b, c


def test_a_load_with_a_floor_evicts_only_nodes_keyed_below_it():
    cache, x, a, b, c = _lru_full_device()
    move = cache.prepare_load([x], keep_lock=False, floor=(2.5,))   # LRU keys are (last_access,)
    assert move is not None
    cache.complete(move)
    assert (x.tier, a.tier, b.tier, c.tier) == (Tier.DEVICE, Tier.HOST, Tier.DEVICE, Tier.DEVICE)
    cache.check()


def test_a_load_whose_room_lies_above_its_floor_changes_nothing(monkeypatch):
    cache, x, a, b, c = _lru_full_device()
    before = (list(cache.usage), cache.stats.evictions)
    keyed = []   # refused before the pin: no node is re-keyed (a queued load is offered every round)
    monkeypatch.setattr(cache, "refresh", keyed.append)
    assert cache.prepare_load([x], keep_lock=False, floor=(0.5,)) is None
    assert keyed == []
    assert (list(cache.usage), cache.stats.evictions) == before
    assert x.lock == 0 and {a.tier, b.tier, c.tier} == {Tier.DEVICE}
    monkeypatch.undo()
    cache.check()


def test_room_below_the_floor_must_cover_the_whole_load():
    # xy needs 2 blocks; only a (t=1) is keyed below 1.5: nothing is evicted, not even a
    cache, _ = make_cache(device=3 * BLOCK, host=8 * BLOCK)
    put(cache, "xy", 0.0)
    nodes = [put(cache, p, t) for p, t in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    xy = cache.tree.match(ids("xy"))[0]
    assert xy.tier == Tier.HOST and xy.tokens == 2 * BLOCK
    assert cache.prepare_load(cache.below_device(xy), keep_lock=False, floor=(1.5,)) is None
    assert all(n.tier == Tier.DEVICE for n in nodes)
    move = cache.prepare_load(cache.below_device(xy), keep_lock=False, floor=(2.5,))
    assert move is not None
    cache.complete(move)
    assert [n.tier for n in nodes] == [Tier.HOST, Tier.HOST, Tier.DEVICE]
    cache.check()


def _queued_on_host():
    """pbkv, device of 6 blocks, host 50. Workflow 3 ended and left RRR (retired) on the device;
    w1's AAA and w2's BBB were evicted to the host; then a call of w1 (t=5) and one of w2 (t=6)
    arrive, each extending its workflow's prefix, and wait."""
    cache, pol, _ = make({"w1": W1, "w2": W2, "w3": W2}, device=6, host=50)
    for w in (1, 2, 3):
        pol.on_workflow_start(w, f"w{w}")
    aaa = call(cache, pol, "AAA", 1.0, 1, "a", 0, context="w1")
    bbb = call(cache, pol, "BBB", 2.0, 2, "b", 0, context="w2")
    assert cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))
    call(cache, pol, "RRR", 3.0, 3, "a", 0, context="w3")
    pol.on_workflow_end(3, cache.end_workflow(3))
    assert aaa.tier == bbb.tier == Tier.HOST
    assert arrive(cache, pol, "AAAx", 5.0, 1, "a", 1, "w1")[0] is aaa
    assert arrive(cache, pol, "BBBx", 6.0, 2, "b", 1, "w2")[0] is bbb
    return cache, pol, aaa, bbb


def _prefetch(cache, pol, now):
    wanted = pol.prefetch(PrefetchRequest(100 * BLOCK, cache.free(Tier.DEVICE), now))
    loaded = []
    for move, _ in prepare_prefetches(cache, wanted, 100 * BLOCK, pol.allow_evict_for_prefetch,
                                      lambda n: False, pol.prefetch_floor):
        cache.complete(move)
        loaded.append(move.nodes[-1])
    return wanted, loaded


def test_queued_prefixes_load_in_arrival_order_into_free_and_lower_ranked_space():
    cache, pol, aaa, bbb = _queued_on_host()
    rrr = cache.tree.match(ids("RRR"))[0]
    assert rrr.tier == Tier.DEVICE and pol.scores.is_retired(rrr)
    wanted, loaded = _prefetch(cache, pol, 7.0)
    assert wanted[:2] == [aaa, bbb]          # the earlier arrival first
    assert loaded == [aaa, bbb]              # AAA into free space; BBB displaces the retired RRR
    assert rrr.tier == Tier.HOST and aaa.tier == bbb.tier == Tier.DEVICE
    cache.check()


@pytest.mark.parametrize("first", ["w1", "w2"])
def test_a_queued_prefix_displaces_another_only_when_its_call_came_first(first):
    # device of 3 blocks: w1's AAA on it, w2's BBB on the host; both workflows' calls wait.
    # BBB may take AAA's place only if w2's call arrived before w1's (it is read first).
    cache, pol, _ = make({"w1": W1, "w2": W2}, device=3, host=50)
    for w in (1, 2):
        pol.on_workflow_start(w, f"w{w}")
    bbb = call(cache, pol, "BBB", 1.0, 2, "b", 0, context="w2")
    aaa = call(cache, pol, "AAA", 2.0, 1, "a", 0, context="w1")
    assert (aaa.tier, bbb.tier) == (Tier.DEVICE, Tier.HOST)
    t1, t2 = (5.0, 6.0) if first == "w1" else (6.0, 5.0)
    arrive(cache, pol, "AAAx", t1, 1, "a", 1, "w1")
    arrive(cache, pol, "BBBx", t2, 2, "b", 1, "w2")
    wanted, loaded = _prefetch(cache, pol, 7.0)
    assert wanted == [bbb]                   # AAA is on the device already
    if first == "w1":
        assert loaded == [] and (aaa.tier, bbb.tier) == (Tier.DEVICE, Tier.HOST)
    else:
        assert loaded == [bbb] and (aaa.tier, bbb.tier) == (Tier.HOST, Tier.DEVICE)
    cache.check()


def test_a_predicted_load_may_displace_retired_nodes_only():
    cache, pol, aaa, bbb = _queued_on_host()
    assert pol.prefetch_floor(bbb) == (2, -6.0, bbb.last_access)   # a read at its call's arrival (full trust)
    pol.on_call_end(CallEvent(2, "b", 1, SimpleNamespace(context="w2", workflow_id="w2", step=1), bbb, 6.5))
    assert pol.prefetch_floor(bbb) == (1,)   # no call waits on it: below every live key, above retired ones
    rrr = cache.tree.match(ids("RRR"))[0]
    assert pol.priority(rrr) < (1,) <= min(pol.priority(aaa), pol.priority(bbb))
