"""Staleness (`policy/staleness.py`) by hand, and how it changes pbkv's order."""

import pytest

from pbkv.policy.staleness import BUCKETS, Staleness, bucket
from test_pbkv_policy import call, make
from test_policies import eviction_order, labels


def q(s, key, passed, since):
    return s._build(key)[bucket(passed) * BUCKETS + bucket(since)]


def test_buckets_are_exact_to_three_then_one_per_doubling():
    assert [bucket(x) for x in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 1000)] == \
        [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]


def test_a_call_is_a_chance_for_the_blocks_of_agents_whose_cache_it_reads():
    s = Staleness()
    s.call(1, "p", [1, 2, 3])        # call 0
    s.call(1, "c", [10])             # call 1: 1, 2, 3 in state (0, 0): no evidence counted
    assert s.live(1, 3) == 1.0       # (0 of p's calls, 1 call) since: no samples yet
    s.call(1, "p", [1, 2, 4])        # call 2: a chance for 1, 2, 3 in (0, 1); 1 and 2 read
    s.call(1, "p", [1, 2, 3, 5])     # call 3: 3 read in (1, 2)
    s.call(1, "p", [1, 2, 6])        # call 4: 4 (sent by call 2) not read in (1, 1)
    s.end(1)                         # 10 had no chance: no call of c, nor of an agent seen reading c's cache
    # Q = (reads + 1) / (chances + 1) per (key, state); (p, sent once):
    assert q(s, ("p", 1), 0, 1) == pytest.approx(3 / 4)   # 1, 2, 3: two read
    assert q(s, ("p", 1), 1, 2) == pytest.approx(2 / 2)   # 3 read
    assert q(s, ("p", 1), 1, 1) == pytest.approx(1 / 2)   # 4 not
    assert q(s, ("p", 1), 2, 2) == 1.0                    # no chance in that state
    assert all(x == 1.0 for x in s._build(("c", 1)))
    assert s.readers.by_agent == {}                   # p sent again only blocks p first sent: no other reader
    assert len(s._build(("p", 1))) == BUCKETS * BUCKETS
    s.call(2, "p", [1, 2, 3])
    s.call(2, "p", [7])
    assert s.live(2, 3) == pytest.approx(1 / 2)    # (1, 1)
    s.call(2, "c", [20])
    assert s.live(2, 3) == 1.0                     # (1, 2): the one such block was read
    assert s.live(2, 20) == 1.0                    # c's block, no call since its sender ...
    s.call(2, "p", [8])
    assert s.live(2, 20) == 1.0                    # ... then one of p, which does not read c's cache
    assert s.live(2, 3) == 1.0                     # (2, 3): no samples
    assert s.live(2, 99) == 1.0                    # a block the workflow never sent
    assert s.live(1, 3) == 1.0                     # workflow 1 ended: forgotten


def test_a_partner_that_reads_an_agents_cache_makes_its_calls_chances():
    s = Staleness()
    for w in (1, 2):
        o = 100 * w                  # each workflow its own blocks (one both sent would be a preamble)
        s.call(w, "p", [o + 1, o + 5])   # call 0
        s.call(w, "r", [o + 30])         # call 1
        s.call(w, "q", [o + 1, o + 2])   # call 2: q extends p's conversation (1); p's tail 5 is not sent again
        s.call(w, "q", [o + 40])         # call 3: q's call, a chance for 5 again
        s.end(w)
    assert s.readers.by_agent == {"p": {"q"}}
    assert q(s, ("p", 1), 0, 1) == pytest.approx(3 / 5)   # 1 and 5 at call 2: 1 read
    assert q(s, ("p", 1), 0, 2) == pytest.approx(1 / 3)   # 5 at call 3: not read
    assert all(x == 1.0 for x in s._build(("r", 1)))       # no call reads r's cache: no chances


def test_a_conversation_whose_phase_ended_is_told_from_one_its_partner_answered():
    # ChatDev-like: phase 1, p and q alternate, each extending its own conversation; phase 2,
    # r calls, then p and q again, each in a new conversation. During phase 1 p's conversation
    # is read at p's next call (a = 0, c = 1); once p's next call started a new one, the old
    # one is not read at p's calls any more (a >= 1)
    s = Staleness()
    for w in (1, 2):
        s.call(w, "p", [1])
        s.call(w, "q", [10])
        s.call(w, "p", [1, 2])
        s.call(w, "q", [10, 11])
        s.call(w, "r", [100])
        for i in range(2):
            s.call(w, "p", [50, 51 + i])
            s.call(w, "q", [60, 61 + i])
        s.end(w)
    s.call(3, "p", [1, 2])
    s.call(3, "q", [10])
    live = s.live(3, 1)                 # p's conversation after its partner's call
    s.call(3, "r", [100])
    s.call(3, "p", [50])
    s.call(3, "q", [60])
    ended = s.live(3, 1)                # p's call since started another conversation
    assert ended < 0.5 < live


def test_the_same_call_seen_twice_counts_each_block_once():
    s = Staleness()
    s.call(1, "p", [1, 2])
    s.add(1, "p", [1, 2, 3])      # its full prompt path, once inserted: nothing sent again
    assert not s.sent[1]
    s.call(1, "c", [9])
    s.call(1, "p", [1, 2, 3])     # 1, 2, 3 sent again once each, in state (0, 1)
    s.call(1, "p", [7])
    assert q(s, ("p", 1), 0, 1) == pytest.approx(4 / 4)
    assert s._row(s.chances, ("p", 1))[1] == 3


PLAN = ([[1, 0, 0, 0], [0, 1, 0, 0]], [1.0, 1.0])   # agent a next, then b


def scenario(stale=True):
    cache, pol, _ = make({"w1": PLAN, "w2": PLAN, "w3": PLAN}, device=40)
    if not stale:
        pol.next_use.stale.state = lambda w, block: None
    # an ended workflow teaches: a's conversation left unread for a call is rarely read again
    pol.on_workflow_start(3, "w3")
    for i, prompt in enumerate(["Ka", "Lb", "Lbc", "Lbcd"]):
        call(cache, pol, prompt, 1.0 + i / 10, 3, "a", i, context="w3")
    pol.on_workflow_end(3, cache.end_workflow(3))
    # K, Ka: sent once, not read at a's calls 2 and 3 (states (1, 1), (2, 2)); no call followed (3, 3)
    learned = pol.next_use.stale
    assert [q(learned, ("a", 1), g, g) for g in (1, 2, 3, 4)] == pytest.approx([1 / 3, 1 / 3, 1.0, 1.0])
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
    # kept for that call; with it, Ma (passed over by two calls of a: read with p 1/3) goes
    # first, and w2's live conversation stays the last to go.
    retired = labels("Ka", "Lbcd", "Lbc", "Lb")
    assert eviction_order(scenario(stale=False)) == retired + labels("Na", "Ma", "Pbc", "Pb")
    assert eviction_order(scenario()) == retired + labels("Ma", "Na", "Pbc", "Pb")


def test_readers_are_named_by_a_block_s_first_sender_not_its_latest():
    # dialogue-like: every prompt starts with the shared preamble (1, 2); the router's and the
    # specialist's conversations (10..., 20...) are their own. Each call sends the preamble the
    # previous call sent: by the latest sender, the router "read" the specialist's cache
    s = Staleness()
    s.call(1, "router", [1, 2, 10])
    s.call(1, "billing", [1, 2, 20])
    s.call(1, "router", [1, 2, 10, 11])
    s.call(1, "billing", [1, 2, 20, 21])
    assert s.readers.by_agent == {"router": {"billing"}}      # billing sends the preamble the router sent first
    s.call(1, "router", [1, 2, 10, 11, 12])          # not a chance for billing's conversation
    s.end(1)
    assert q(s, ("billing", 1), 0, 1) == 1.0         # billing's 20: read at billing's next call only
    assert all(x == 1.0 for x in s._build(("billing", 1)))


def test_a_preamble_other_workflows_sent_too_names_no_reader():
    # the same dialogue, two workflows: the preamble (1, 2) heads every prompt of both, so it is
    # the framework's, not the router's cache the specialist reads; the router's own block 10,
    # sent again by billing, still makes billing a reader of the router
    s = Staleness()
    for w in (1, 2):
        s.call(w, "router", [1, 2, 10 * w])
    s.call(1, "billing", [1, 2, 30])
    s.call(2, "billing", [1, 2, 40])
    assert s.readers.by_agent == {}
    s.call(2, "billing", [1, 2, 20, 21])
    assert s.readers.by_agent == {"router": {"billing"}}


def test_a_preamble_is_recognised_after_the_workflow_that_sent_it_ended():
    s = Staleness()
    s.call(1, "router", [1, 2, 10])
    s.end(1)
    s.call(2, "router", [1, 2, 20])
    s.call(2, "billing", [1, 2, 30])    # sequential workflows: the preamble is still known shared
    assert s.readers.by_agent == {}


def test_readers_learned_from_a_preamble_are_taken_back_once_another_workflow_sends_it():
    # a server running one workflow at a time: while the first runs, its preamble (1, 2) looks
    # like the router's cache that billing reads; the next workflow sends it too, so it was the
    # framework's, and the edge it alone evidenced goes (block 10 keeps router -> auditor)
    s = Staleness()
    s.call(1, "router", [1, 2, 10])
    s.call(1, "billing", [1, 2, 30])
    s.call(1, "auditor", [1, 2, 10, 11])
    assert s.readers.by_agent == {"router": {"billing", "auditor"}}
    s.end(1)
    version = s.readers.version
    s.call(2, "router", [1, 2, 20])
    assert s.readers.by_agent == {"router": {"auditor"}}
    assert s.readers.version != version      # NextUse's memo of reader groups is redone


def test_an_edge_whose_evidence_was_forgotten_is_kept():
    from pbkv.policy.readers import Readers
    r = Readers(memory=1)
    r.read(1, "a", "b")
    r.read(2, "a", "c")                  # block 1 forgotten: a -> b can no longer be taken back
    r.shared(1)
    r.shared(2)
    assert r.by_agent == {"a": {"b"}} and r.count == {("a", "b"): 1}


def test_shared_blocks_memory_is_bounded_oldest_forgotten_first():
    from pbkv.policy.shared_blocks import SharedBlocks
    m = SharedBlocks(memory=2)
    m.sent(1, 100)
    m.end(1, [100])
    for b in (1, 2, 3):
        m.sent(2, b)
    m.end(2, [1, 2, 3])                  # ended blocks: 100, 1, 2, 3 -> the two latest kept
    assert list(m.ended) == [2, 3] and m.owner == {}
    m.sent(3, 100)                       # forgotten: counts as sent by workflow 3 alone
    m.sent(3, 3)
    assert not m.is_shared(100) and m.is_shared(3)
    m.sent(4, 100)
    m.sent(4, 2)                         # shared: 3, 100, 2 -> the least recently sent (3) goes
    assert list(m.shared) == [100, 2]
    m.sent(5, 100)                       # sent again: now the most recent
    assert list(m.shared) == [2, 100]
