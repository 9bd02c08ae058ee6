"""Admission below the device (`policy/admission.py`): a write is judged by what it finally
pushes out of the cache, at the bottom of the cascade, not by the next tier's victim alone."""

from helpers import BLOCK, ids, put, resident
from pbkv.cache import Capacities, RadixTree, TieredCache
from pbkv.policy import Policy, PolicyContext
from pbkv.policy.admission import worth_writing


class Ranked(Policy):
    """Ranks single-block nodes by a fixed value of their prompt (smaller is evicted first)
    and admits with `worth_writing`."""

    def __init__(self, values):
        super().__init__(PolicyContext(block_size=BLOCK))
        self.values = values
        self.label = {ids(p)[-1]: p for p in values}

    def priority(self, node):
        return (self.values[self.label[node.blocks[-1]]],)

    def keep_on_evict(self, node):
        return worth_writing(self.cache, node, self.priority)


def fill(values, prompts, host=1, disk=1):
    """One block per tier; insert `prompts` in order (each evicts the previous one down)."""
    pol = Ranked(values)
    cache = TieredCache(RadixTree(BLOCK), Capacities(BLOCK, host * BLOCK, disk * BLOCK), pol)
    pol.bind(cache)
    for t, p in enumerate(prompts):
        put(cache, p, float(t))
        cache.check()
    return resident(cache)


def test_a_node_below_the_host_victim_still_displaces_a_worse_disk_victim():
    # a (0) sinks to disk, b (9) sits on host; evicting c (5) pushes b to disk and a out.
    # Judged against the host's victim alone (b, 9 > 5), c would have been dropped.
    assert fill({"a": 0, "b": 9, "c": 5, "x": 7}, ["a", "b", "c", "x"]) == \
        {"DEVICE": ["x"], "HOST": ["c"], "DISK": ["b"]}


def test_a_node_worth_less_than_every_victim_below_is_dropped():
    assert fill({"a": 6, "b": 9, "c": 5, "x": 7}, ["a", "b", "c", "x"]) == \
        {"DEVICE": ["x"], "HOST": ["b"], "DISK": ["a"]}


def test_free_space_below_always_admits():
    # host full of better nodes, disk empty: the worst node still goes down (filling costs nothing)
    assert fill({"b": 9, "c": 1, "x": 7}, ["b", "c", "x"]) == \
        {"DEVICE": ["x"], "HOST": ["c"], "DISK": ["b"]}
