"""Staleness (`policy/staleness.py`) by hand, and how it changes pbkv's order."""

import pytest

from pbkv.policy.staleness import MAX_GAP, Staleness
from test_pbkv_policy import call, make
from test_policies import eviction_order, labels


def test_gaps_count_the_agents_own_calls_that_passed_a_block_over():
    s = Staleness()
    s.call(1, "p", [1, 2, 3])        # p's call 1
    s.call(1, "c", [10])             # another agent's call does not pass p's blocks over
    assert s.live(1, 3) == 1.0       # gap 0: no evidence about the block itself
    s.call(1, "p", [1, 2, 4])        # p's call 2: 1, 2 read at gap 0; 3 passed over (gap 1)
    assert s.live(1, 3) == 1.0       # no "never" sample yet: no evidence against it
    s.call(1, "p", [1, 2, 3, 5])     # 3 read at gap 1
    s.call(1, "p", [1, 2, 6])        # 3 (now sent twice), 5 passed over once, 4 twice
    s.end(1)
    # key (p, sent once): reads at gap 0: 2 (blocks 1, 2), gap 1: 1 (block 3);
    #   never: 6 at final gap 0, 5 at 1, 4 at 2
    # key (p, sent more): reads at gap 0: 4; never: 1, 2 at gap 0, 3 at gap 1
    # Q(g) = (reads at gaps >= g + 1) / (reads at gaps >= g + nevers at gaps >= g + 1)
    assert s._build(("p", 1))[:4] == pytest.approx([4 / 7, 2 / 4, 1 / 2, 1.0])
    assert s._build(("p", 2))[:3] == pytest.approx([5 / 8, 1 / 2, 1.0])
    assert len(s._build(("p", 1))) == MAX_GAP + 2
    s.call(2, "p", [1, 2, 3])
    s.call(2, "c", [20])
    assert s.live(2, 3) == 1.0                     # only another agent's call passed
    s.call(2, "p", [7])
    assert s.live(2, 3) == pytest.approx(1 / 2)    # passed over by one call of p
    s.call(2, "p", [8])
    assert s.live(2, 3) == pytest.approx(1 / 2)
    s.call(2, "p", [9])
    assert s.live(2, 3) == 1.0                     # no block was ever passed over 3 times
    assert s.live(2, 99) == 1.0                    # a block the workflow never sent
    assert s.live(1, 3) == 1.0                     # workflow 1 ended: forgotten


def test_the_same_call_seen_twice_counts_each_block_once():
    s = Staleness()
    s.call(1, "p", [1, 2])
    s.add(1, "p", [1, 2, 3])      # its full prompt path, once inserted: no read samples
    assert not s.reads


PLAN = ([[1, 0, 0, 0], [0, 1, 0, 0]], [1.0, 1.0])   # agent a next, then b


def scenario(stale=True):
    cache, pol, _ = make({"w1": PLAN, "w2": PLAN, "w3": PLAN}, device=40)
    if not stale:
        pol.next_use.stale.live = lambda w, block: 1.0
    # an ended workflow teaches: a's conversation left unread for a call is rarely read again
    pol.on_workflow_start(3, "w3")
    for i, prompt in enumerate(["Ka", "Lb", "Lbc", "Lbcd"]):
        call(cache, pol, prompt, 1.0 + i / 10, 3, "a", i, context="w3")
    pol.on_workflow_end(3, cache.end_workflow(3))
    # K, Ka: sent once, passed over by a's three later calls, never read
    assert pol.next_use.stale._build(("a", 1))[1:5] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    t = pol.next_use.timing
    t.duration, t.wait, t.mean_duration, t.mean_wait = {"a": 2.0}, {"a": 1.0}, 2.0, 1.0
    pol.on_workflow_start(1, "w1")
    pol.on_workflow_start(2, "w2")
    call(cache, pol, "Ma", 2.0, 2, "a", 0, context="w2")    # w2's first conversation ...
    call(cache, pol, "Pb", 2.5, 2, "a", 1, context="w2")    # ... passed over by two calls of a
    call(cache, pol, "Pbc", 3.0, 2, "a", 2, context="w2")
    call(cache, pol, "Na", 4.0, 1, "a", 0, context="w1")    # w1's live conversation
    return cache


def test_a_stale_conversation_goes_before_a_live_one_of_a_later_workflow():
    # both workflows call a next; w2 sooner. Without staleness w2's old conversation Ma is
    # kept for that call; with it, Ma (passed over by two calls of a: p capped at 1/3) goes
    # first, and w2's live conversation stays the last to go.
    retired = labels("Ka", "Lbcd", "Lbc", "Lb")
    assert eviction_order(scenario(stale=False)) == retired + labels("Na", "Ma", "Pbc", "Pb")
    assert eviction_order(scenario()) == retired + labels("Ma", "Na", "Pbc", "Pb")
