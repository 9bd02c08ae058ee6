"""Predicted next use (`policy/next_use.py`) by hand, and pbkv's order and admission below the device."""

import pytest

from helpers import ids, resident
from pbkv.cache import Tier
from pbkv.policy.next_use import NextUse, Timing
from pbkv.policy.reuse_score import ReuseScores
from test_pbkv_policy import call, make
from test_policies import eviction_order, labels
from test_staleness import q


def test_timing_learns_per_agent_durations_and_waits():
    t = Timing(alpha=0.5)
    t.call_start(1, "a", 0.0)
    t.call_end(1, "a", 2.0)          # a took 2 s
    t.call_start(1, "b", 3.0)        # 1 s of tool wait before b
    t.call_end(1, "b", 7.0)
    t.call_start(2, "a", 10.0)
    t.call_end(2, "a", 14.0)         # a took 4 s: running mean 2 + .5 * (4 - 2)
    assert t.duration == {"a": 3.0, "b": 4.0}
    assert t.wait == {"b": 1.0}
    assert t.of(t.wait, "a") == 1.0  # never seen: the mean over agents
    assert t.step == pytest.approx(t.mean_duration + t.mean_wait)


def estimator():
    scores = ReuseScores(horizon=2)
    probs = [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]
    survival = [1.0, 0.5]
    scores.update(1, ["a", "b", "<unk>"], probs, survival)
    nu = NextUse(scores, horizon=2)
    nu.timing.duration, nu.timing.wait = {"a": 2.0, "b": 4.0}, {"a": 1.0, "b": 0.0}
    nu.timing.mean_duration, nu.timing.mean_wait = 3.0, 0.5
    return nu, probs, survival


def test_expected_next_use_by_hand():
    nu, probs, survival = estimator()
    nu.update(1, "b", 10.0, probs, survival, pending=False)
    # call 1 issues at 10 + E[wait] = 10.5 (a or b, .5 each), ends at 10.5 + E[dur] = 13.5;
    # call 2 (alive .5, agent a) issues at 14.5. Effective time: now + (E[t | read] - now) / p
    assert nu.prob[1] == pytest.approx([0.75, 0.5, 0.0])
    cond_a = (0.5 * 10.5 + 0.25 * 14.5) / 0.75
    # c is never read within the horizon: one mean step past it (16.5 + 3.5), stretched by 1 / .5
    assert nu.when[1] == pytest.approx([10 + (cond_a - 10) / 0.75, 10 + 0.5 / 0.5, 23.5])
    # a call of b that arrived and has not ended reads b's cache now; the horizon starts when
    # it is expected to end (10 + 4 s)
    nu.update(1, "b", 10.0, probs, survival, pending=True)
    assert nu.when[1][1] == 10.0 and nu.prob[1][1] == 1.0
    cond_a = (0.5 * 14.5 + 0.25 * 18.5) / 0.75
    assert nu.when[1][0] == pytest.approx(10 + (cond_a - 10) / 0.75)
    assert nu.first == nu.when[1] and nu.pmax == nu.prob[1]   # one workflow: its values
    assert nu.remove(1) and nu.first == [float("inf")] * 3


# the last call of w1 predicts: a next, then b; c never again
PLAN = ([[1, 0, 0, 0], [0, 1, 0, 0]], [1.0, 1.0])


def scenario(device=20, host=50):
    cache, pol, _ = make({"w1": PLAN, "w2": PLAN}, device=device, host=host)
    pol.on_workflow_start(1, "w1")
    pol.on_workflow_start(2, "w2")
    call(cache, pol, "Ra", 1.0, 2, "a", 0, context="w2")
    pol.on_workflow_end(2, cache.end_workflow(2))             # Ra: retired
    call(cache, pol, "Xc", 2.0, 1, "c", 0, context="w1")      # Xc: c predicted never (dead)
    call(cache, pol, "Zb", 3.0, 1, "b", 1, context="w1")      # Zb: b in two calls
    call(cache, pol, "Ya", 4.0, 1, "a", 2, context="w1")      # Ya: a in the next call
    return cache, pol


def test_order_retired_then_dead_then_farthest_next_use():
    cache, pol = scenario()
    assert eviction_order(cache) == labels("Ra", "Xc", "Zb", "Ya")


def test_host_ranks_like_the_device_and_dead_nodes_only_fill_free_space():
    cache, pol = scenario()
    cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))
    # room for all: everything is written down, and the host ranks as the device did
    assert cache.candidates(Tier.HOST) == [cache.tree.match(ids(p))[0] for p in ("Ra", "Xc", "Zb", "Ya")]
    cache, pol = scenario(host=4)   # room for two of the four 2-block nodes
    cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))
    # Ra and Xc filled the free host space; Zb and Ya (predicted reuse) displaced them
    assert resident(cache) == {"HOST": ["Ya", "Zb"]}
    cache.check()


def test_admission_into_a_full_tier_only_above_its_next_victim():
    cache, pol = scenario(host=2)   # the host holds one 2-block node
    cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))
    assert resident(cache) == {"HOST": ["Ya"]}   # Zb went first, then Ya (sooner) displaced it
    call(cache, pol, "Wb", 5.0, 1, "b", 3, context="w1")   # prediction unchanged: b in two calls
    victim = cache.next_victim(Tier.HOST)
    assert victim is cache.tree.match(ids("Ya"))[0]
    assert not pol.keep_on_evict(cache.tree.match(ids("Wb"))[0])   # b is later than Ya's a
    cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))
    assert resident(cache) == {"HOST": ["Ya"]}
    cache.check()


def test_class_extremes_stay_exact_over_updates_and_removals():
    import random
    rng = random.Random(3)
    scores = ReuseScores(horizon=2)
    scores.update(0, ["a", "b", "<unk>"], [[1, 0, 0], [0, 1, 0]], [1.0, 1.0])
    nu = NextUse(scores, horizon=2)
    for i in range(300):
        w = rng.randrange(6)
        if rng.random() < 0.2:
            nu.remove(w)
        else:
            probs = [[rng.random() for _ in range(3)] for _ in range(2)]
            probs = [[x / sum(r) for x in r] for r in probs]
            nu.update(w, rng.choice("ab"), float(i), probs, [rng.random(), 0.0], pending=rng.random() < .5)
        for a in range(3):
            assert nu.first[a] == min((v[a] for v in nu.when.values()), default=float("inf"))
            assert nu.pmax[a] == max((v[a] for v in nu.prob.values()), default=0.0)


def test_readers_are_learned_from_the_blocks_calls_send_again():
    cache, pol, _ = make({"w1": PLAN})
    pol.on_workflow_start(1, "w1")
    call(cache, pol, "Ca", 1.0, 1, "a", 0, context="w1")
    call(cache, pol, "Ce", 2.0, 1, "c", 1, context="w1")   # sends "C" again: a's call sent it first
    assert pol.next_use.stale.readers.by_agent == {"a": {"c"}}
    # one conversation: a's cache ("Ca") is read by the next call, of a (PLAN: a next) or c
    assert pol.next_use.of(cache.tree.match(ids("Ca"))[0])[1] == 1.0


def test_a_common_node_is_discounted_by_its_share_of_workflows():
    from types import SimpleNamespace
    nu, probs, survival = estimator()
    nu.scores.bind({"a": 0, "b": 1})
    nu.update(1, "b", 10.0, probs, survival, pending=False)
    nu.scores.workflows_seen = 40
    step = nu.timing.step
    a_first, a_p = nu.first[0], nu.pmax[0]
    # read by every workflow so far (a framework preamble): the earliest call of a reads it
    preamble = SimpleNamespace(seen_workflows=40, agent_mask=0b01, wf_agents={})
    assert nu.of(preamble) == pytest.approx((a_first, a_p))
    # shared by 4 of 40 workflows: common, but a running workflow reads it only a tenth as
    # often; 9 mean steps later, probability scaled by .1
    rare = SimpleNamespace(seen_workflows=4, agent_mask=0b01, wf_agents={})
    assert nu.scores.is_common(rare)
    assert nu.of(rare) == pytest.approx((a_first + 9 * step, 0.1 * a_p))
    # ... unless an active workflow used it itself: its own prediction counts in full
    mine = SimpleNamespace(seen_workflows=4, agent_mask=0b01, wf_agents={1: 0b01}, blocks=[0])
    assert nu.of(mine) == pytest.approx((nu.when[1][0], nu.prob[1][0]))


def test_effective_time_ranks_by_reads_per_second():
    from pbkv.policy.next_use import effective_time
    sure_in_3 = effective_time(0.0, 1.0 * 3.0, 1.0)       # read surely 3 s from now
    maybe_in_1 = effective_time(0.0, 0.1 * 1.0, 0.1)      # read with p .1, 1 s from now
    assert sure_in_3 == 3.0 and maybe_in_1 == pytest.approx(10.0)
    assert effective_time(5.0, 0.0, 0.0, far=9.0) == 9.0   # never within the horizon
    assert effective_time(5.0, 7.0, 1.0) == 7.0   # p = 1: the plain expected time


def test_a_block_s_read_chance_is_its_staleness_at_each_predicted_call_not_now():
    # ChatDev's review loop: p and its reviewer r alternate; r reads p's conversation (it sends
    # block 5 again, which p sent first), p reads its own conversation of two calls back. An
    # ended workflow teaches: p's block 6 is not read at r's call in state (a=1, c=2) and is
    # read at p's call in (1, 3).
    scores = ReuseScores(horizon=2)
    nu = NextUse(scores, horizon=2)
    st = nu.stale
    for agent, blocks in [("p", [5, 6]), ("r", [5, 10]), ("p", [7]), ("r", [8]), ("p", [5, 6, 9])]:
        st.call(1, agent, blocks)
    st.end(1)
    assert st.readers.of("p") == {"r"}
    q12, q13 = q(st, ("p", 1), 1, 2), q(st, ("p", 1), 1, 3)
    assert (q12, q13) == (pytest.approx(1 / 2), 1.0)
    # workflow 2 is where 1 was after its call 2: block 6 now in state (1, 2); r next, then p
    for agent, blocks in [("p", [15, 16]), ("r", [15, 20]), ("p", [17])]:
        st.call(2, agent, blocks)
    probs, survival = [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], [1.0, 1.0]
    scores.bind({"p": 0, "r": 1})
    scores.update(2, ["p", "r", "<unk>"], probs, survival)
    nu.update(2, "p", 10.0, probs, survival, pending=False)
    scores._extend_bits()                                # as `NextUse.of` does first
    when, p = nu._read(2, 16, mask=0b1)
    # r's call reads it with Q(1, 2), else p's call with Q(1, 3): the previous rule's cap was
    # Q(1, 2) = 1/2 for the pair of calls
    assert p == pytest.approx(q12 + (1 - q12) * q13) == pytest.approx(1.0)
    assert nu._read(2, 99, mask=0b1) is None            # never sent: no staleness evidence
