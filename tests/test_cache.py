"""The cache mechanism: radix tree operations, tiers, atomic eviction, two-phase moves."""

import pytest

from helpers import BLOCK, ids, make_cache, put, resident
from pbkv.cache import Capacities, RadixTree, TieredCache, Tier, TreeError


def test_match_insert_split():
    tree = RadixTree(BLOCK)
    leaf, new = tree.insert(ids("abcd"), BLOCK, Tier.DEVICE, 0.0)
    assert [n.blocks for n in new] == [ids("abcd")]
    node, matched = tree.match(ids("abxy"))
    assert node is leaf and matched == 2
    leaf2, new2 = tree.insert(ids("abxy"), BLOCK, Tier.DEVICE, 1.0)
    upper = leaf.parent
    assert upper.blocks == ids("ab") and leaf.blocks == ids("abcd")[2:] and leaf2.parent is upper
    assert upper.tokens == 2 * BLOCK and leaf.tokens == 2 * BLOCK
    assert tree.match(ids("abcdz")) == (leaf, 4)
    assert tree.match(ids("zz")) == (tree.root, 0)
    tree.check()


def test_partial_tail_block_cannot_be_extended():
    tree = RadixTree(BLOCK)
    leaf, _ = tree.insert(ids("ab"), 2, Tier.DEVICE, 0.0)
    assert leaf.tokens == BLOCK + 2
    with pytest.raises(TreeError):
        tree.insert(ids("abc"), BLOCK, Tier.DEVICE, 0.0)  # a chained trace never does this


def test_split_keeps_locks_and_tags():
    tree = RadixTree(BLOCK)
    leaf, _ = tree.insert(ids("pqrs"), BLOCK, Tier.DEVICE, 0.0)
    tree.lock(leaf)
    tree.touch(leaf, 5.0, workflow=7, agent="planner")
    tree.insert(ids("pqzz"), BLOCK, Tier.DEVICE, 6.0)
    upper = leaf.parent
    assert upper.lock == 1 and upper.wf_agents == leaf.wf_agents and upper.last_access == 5.0
    assert upper.id in tree.workflow_nodes[7]
    tree.unlock(leaf)
    assert upper.lock == 0
    tree.check()


class DeepestFirst:
    """Evicts the node that starts deepest in its prompt first (a key read from the node's content)."""

    def priority(self, node):
        return (-node.start,)

    def keep_on_evict(self, node):
        return False

    def on_evict(self, node, src, dst):
        pass


def test_a_split_node_is_ranked_by_its_new_content():
    cache = TieredCache(RadixTree(BLOCK), Capacities(16 * BLOCK), DeepestFirst())
    old = put(cache, "jklm", 1.0)        # one node, starting at block 0
    put(cache, "jkx", 2.0)               # cuts it: its lower part "lm" now starts at block 2
    put(cache, "y", 3.0)
    assert old.start == 2 and old.key == (-2,)
    assert cache.evict(Tier.DEVICE, BLOCK)   # the first of the two nodes starting at 2 goes: old, not "x"
    assert resident(cache) == {"DEVICE": ["jk", "jkx", "y"]}
    cache.check()


def test_lru_evicts_least_recent_leaf_first_and_never_locked():
    cache, _ = make_cache(device=8 * BLOCK)
    a = put(cache, "aa", 1.0)
    b = put(cache, "bb", 2.0)
    c = put(cache, "cc", 3.0)
    cache.tree.lock(a)
    assert [n is x for n, x in zip(cache.candidates(Tier.DEVICE), [b, c])] == [True, True]
    assert cache.evict(Tier.DEVICE, 3 * BLOCK)  # frees 2 nodes of 2 blocks: b then c
    assert resident(cache) == {"DEVICE": ["aa"]}
    assert not cache.evict(Tier.DEVICE, 1)  # only the locked node is left: atomic refusal
    assert resident(cache) == {"DEVICE": ["aa"]}
    cache.check()


def test_leaf_first_parent_after_children():
    cache, _ = make_cache(device=10 * BLOCK)
    put(cache, "sysA", 1.0)
    put(cache, "sysB", 5.0)          # shares "sys" with sysA: "sys" becomes an inner node
    put(cache, "zz", 3.0)
    order = []
    cache.rules.on_evict = lambda node, src, dst: order.append((node.blocks[-1], dst))
    assert cache.evict(Tier.DEVICE, 7 * BLOCK)
    label = {ids(p)[-1]: p for p in ["sys", "sysA", "sysB", "zz"]}
    assert [label[b] for b, _ in order] == ["sysA", "zz", "sysB", "sys"]
    assert all(dst is None for _, dst in order)  # no host tier: dropped
    cache.check()


def test_eviction_cascades_device_host_disk_then_drops():
    cache, _ = make_cache(device=4 * BLOCK, host=4 * BLOCK, disk=2 * BLOCK)
    put(cache, "aa", 1.0)
    put(cache, "bb", 2.0)
    put(cache, "cc", 3.0)   # device full: aa -> host
    assert resident(cache) == {"DEVICE": ["bb", "cc"], "HOST": ["aa"]}
    put(cache, "dd", 4.0)   # bb -> host
    put(cache, "ee", 5.0)   # cc -> host needs room: aa -> disk
    assert resident(cache) == {"DEVICE": ["dd", "ee"], "HOST": ["bb", "cc"], "DISK": ["aa"]}
    put(cache, "ff", 6.0)   # dd -> host, bb -> disk, aa dropped
    assert resident(cache) == {"DEVICE": ["ee", "ff"], "HOST": ["cc", "dd"], "DISK": ["bb"]}
    assert cache.stats.dropped == [0, 0, 2 * BLOCK]
    cache.check()


def test_demoted_parent_waits_for_its_children():
    cache, _ = make_cache(device=6 * BLOCK, host=10 * BLOCK)
    put(cache, "abc", 1.0)
    put(cache, "abd", 2.0)   # "ab" inner, "c" and "d" leaves
    assert cache.evict(Tier.DEVICE, 1)      # oldest leaf "abc" goes to host
    assert resident(cache) == {"DEVICE": ["ab", "abd"], "HOST": ["abc"]}
    assert cache.evict(Tier.DEVICE, 3 * BLOCK)  # then "abd", then "ab" (no device child left)
    assert resident(cache) == {"HOST": ["ab", "abc", "abd"]}
    cache.check()


def test_two_phase_load_reserves_pins_and_completes():
    cache, _ = make_cache(device=6 * BLOCK, host=10 * BLOCK)
    put(cache, "aaa", 1.0)
    cache.evict(Tier.DEVICE, 1)
    node = cache.tree.match(ids("aaa"))[0]
    put(cache, "bbb", 2.0)
    move = cache.prepare_load([node], keep_lock=True)
    assert move is not None and node.lock == 1 and node.tier == Tier.HOST
    # the pending load holds its device space: only "bbb" can be evicted
    assert cache.free(Tier.DEVICE) == 0 and cache.evictable(Tier.DEVICE) == 3 * BLOCK
    cache.complete(move)
    assert node.tier == Tier.DEVICE and node.lock == 1
    assert cache.stats.loaded[Tier.HOST] == 3 * BLOCK
    cache.tree.unlock(node)
    cache.check()


def test_prepare_load_refuses_without_room_and_changes_nothing():
    cache, _ = make_cache(device=3 * BLOCK, host=10 * BLOCK)
    put(cache, "aaa", 1.0)
    cache.evict(Tier.DEVICE, 1)
    node = cache.tree.match(ids("aaa"))[0]
    leaf = put(cache, "bbb", 2.0)
    cache.tree.lock(leaf)
    before = (list(cache.usage), list(cache.locked), cache.reserved)
    assert cache.prepare_load([node]) is None
    assert (list(cache.usage), list(cache.locked), cache.reserved) == before and node.lock == 0
    cache.check()


def test_reserve_is_atomic():
    cache, _ = make_cache(device=4 * BLOCK)
    leaf = put(cache, "ab", 1.0)
    cache.tree.lock(leaf)
    assert not cache.reserve(3 * BLOCK)
    assert cache.reserved == 0 and resident(cache) == {"DEVICE": ["ab"]}
    assert cache.reserve(2 * BLOCK)
    cache.release(2 * BLOCK)
    cache.check()


def test_end_workflow_clears_tags_and_marks_retired():
    cache, _ = make_cache(device=20 * BLOCK)
    shared = put(cache, "sys", 1.0, workflow=1, agent="a")
    mine = put(cache, "sysX", 2.0, workflow=1, agent="a")
    put(cache, "sysY", 3.0, workflow=2, agent="b")
    nodes = cache.end_workflow(1)
    assert {n.id for n in nodes} == {shared.id, mine.id}
    assert mine.retired and not shared.retired
    assert shared.agent_mask == 0b11 and shared.seen_workflows == 2


def test_next_victim_is_what_evict_takes_first_and_changes_nothing():
    cache, _ = make_cache(40, 40)
    put(cache, "Pa", 1.0)
    put(cache, "Qb", 2.0)
    assert cache.next_victim(Tier.HOST) is None
    first = cache.next_victim(Tier.DEVICE)
    assert first is cache.tree.match(ids("Pa"))[0]            # LRU: the older one
    assert cache.next_victim(Tier.DEVICE) is first            # peeking removes nothing
    evicted = []
    cache.rules.on_evict = lambda node, src, dst: evicted.append(node)
    cache.evict(Tier.DEVICE, 1)
    assert evicted == [first] and cache.next_victim(Tier.HOST) is first
    cache.check()
