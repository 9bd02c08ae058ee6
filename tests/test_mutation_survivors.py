"""Tests for the bugs that survived a hand-seeded mutation run (issue 14): each fails on its mutant."""

from __future__ import annotations

import pytest

from helpers import BLOCK, ids, make_cache
from pbkv.cache import Node, Tier
from pbkv.cache.tree import TreeError
from pbkv.policy.reuse_score import ReuseScores
from test_pbkv_policy import W1, W2, call, make
from test_policies import eviction_order, labels


def test_unlock_of_an_unlocked_node_raises_and_changes_nothing():
    # mutant: `unlock` lets a lock count go to -1
    cache, _ = make_cache(8 * BLOCK)
    tree = cache.tree
    leaf, _ = tree.insert(ids("ab"), BLOCK, Tier.DEVICE, 0.0)
    tree.lock(leaf)
    tree.unlock(leaf)
    with pytest.raises(TreeError, match="unlock of unlocked"):
        tree.unlock(leaf)
    assert [n.lock for n in leaf.path()] == [0]


def test_remove_subtracts_an_ended_workflow_from_the_totals():
    # mutant: `remove` adds the ended workflow's values instead of subtracting them
    scores = ReuseScores(gamma=0.5, horizon=2)
    scores.bind({"a": 0, "b": 1})
    classes = ["a", "b", "<unk>"]
    scores.update(1, classes, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [1.0, 1.0])   # q1 = (1, .5)
    scores.update(2, classes, [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], [1.0, 1.0])   # q2 = (.5, .5, unk .5)
    common = Node(1, [7], 0, BLOCK, BLOCK, None, Tier.DEVICE, 0.0)
    common.seen_workflows, common.agent_mask = 2, 0b01   # used by both, for agent a
    assert scores.score(common) == pytest.approx(1.5)
    scores.remove(1)
    assert scores.score(common) == pytest.approx(0.5)
    assert scores.total_q == pytest.approx([0.5, 0.5, 0.5])
    assert scores.remove(1) == [] and scores.total_q == pytest.approx([0.5, 0.5, 0.5])  # twice: no-op


def test_workflow_end_re_ranks_a_shared_leaf():
    # mutant: `PBKVPolicy.on_workflow_end` without its `refresh`: the shared leaf Sx keeps the
    # score it had while w1 was running. q_w1 = (a .825, b .425), q_w2 = (a .25, b .5).
    cache, pol, _ = make({"w1": W1, "w2": W2})
    pol.on_workflow_start(1, "w1")
    pol.on_workflow_start(2, "w2")
    call(cache, pol, "Sx", 1.0, 1, "a", 0, context="w1")
    call(cache, pol, "Sx", 2.0, 2, "a", 0, context="w2")   # Sx: used by both for agent a
    call(cache, pol, "Ty", 3.0, 2, "b", 1, context="w2")   # Ty: w2's, agent b (.5)
    # no call started on Sx once it was shared, so only the end of w1 can re-rank it
    sx = cache.tree.match(ids("Sx"))[0]
    assert pol.scores.score(sx) == pytest.approx(0.825 + 0.25)
    pol.on_workflow_end(1, cache.end_workflow(1))
    assert pol.scores.score(sx) == pytest.approx(0.25)
    # Sx (.25) now goes before Ty (.5); with a stale score (1.075) it would go after
    assert eviction_order(cache) == labels("Sx", "Ty")
