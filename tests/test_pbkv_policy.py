"""PBKV: hand-computed scores, retired-first order, conservative prefetch, the feedback loop."""

from types import SimpleNamespace

import pytest

from helpers import BLOCK, FakePredictor, ids, make_cache, put
from pbkv.cache import CacheConfig, Tier
from pbkv.policy import CallEvent, PolicyContext, PrefetchRequest
from test_policies import eviction_order, labels

# P[k][class] over classes (a, b, c, <unk>); survival per step.
W1 = ([[0.8, 0.2, 0, 0], [0.1, 0.9, 0, 0]], [1.0, 0.5])
W2 = ([[0, 1, 0, 0], [1, 0, 0, 0]], [0.5, 0.5])


def make(table, horizon=2, gamma=0.5, device=100, host=0, policy="pbkv"):
    pred = FakePredictor(["a", "b", "c"], horizon, table)
    ctx = PolicyContext(block_size=BLOCK, predictors={"fused": pred}, gamma=gamma)
    cache, pol = make_cache(device * BLOCK, host * BLOCK, policy=policy, ctx=ctx)
    return cache, pol, pred


def arrive(cache, pol, prompt, now, wf, agent, step, context=None):
    """A call arrives (the engine's submit): the policy hears of it with the deepest cached node
    of its prompt. Returns (that node, the call)."""
    node, _ = cache.tree.match(ids(prompt))
    call_ = SimpleNamespace(context=context, workflow_id=f"w{wf}", step=step)
    pol.on_call_start(CallEvent(wf, agent, step, call_, node, now))
    return node, call_


def call(cache, pol, prompt, now, wf, agent, step, context=None):
    """What the engine does for one call: arrival (prediction), serve (insert + tags), end."""
    _, call_ = arrive(cache, pol, prompt, now, wf, agent, step, context)
    leaf = put(cache, prompt, now, workflow=wf, agent=agent)
    pol.on_call_end(CallEvent(wf, agent, step, call_, leaf, now))
    return leaf


def two_workflows(policy="pbkv"):
    cache, pol, pred = make({"w1": W1, "w2": W2}, policy=policy)
    pol.on_workflow_start(1, "w1")
    pol.on_workflow_start(2, "w2")
    call(cache, pol, "Sa1", 1.0, 1, "a", 0, context="w1")
    call(cache, pol, "Sb1", 2.0, 1, "b", 1, context="w1")
    call(cache, pol, "Sa2", 3.0, 2, "a", 0, context="w2")
    return cache, pol


def test_scores_by_hand_on_two_workflows():
    cache, pol = two_workflows()
    # gamma .5: q_w1 = (a .8 + .5*.5*.1, b .2 + .25*.9) = (.825, .425); q_w2 = (a .25, b .5)
    score = {p: pol.scores.score(cache.tree.match(ids(p))[0]) for p in ["S", "Sa1", "Sb1", "Sa2"]}
    assert score["Sa1"] == pytest.approx(0.825)
    assert score["Sb1"] == pytest.approx(0.425)
    assert score["Sa2"] == pytest.approx(0.25)
    # "S" is common (both workflows used it): every active workflow counts, for agents a and b
    assert score["S"] == pytest.approx(0.825 + 0.425 + 0.25 + 0.5)
    # "Sa" (shared by Sa1 and Sa2) is common too: total for agent a = .825 + .25
    assert pol.scores.score(cache.tree.match(ids("Sa"))[0]) == pytest.approx(1.075)
    # The order is by predicted next use (next_use.py), not by score. w1's b call sent again
    # the path "S" that w1's a call had sent, but w2 sent "S" too: it is the preamble, not a's
    # cache that b reads (readers.py: the edge it evidenced is taken back), so b's calls do not
    # read a's. Sa2 is read at w2's call after next (a; w2 calls b first), Sb1 when w1 calls b
    # (.2 next, .45 after): Sa2 is the farthest. (While b counted as a reader of a, Sa2 was read
    # at w2's next call and Sb1 went first; had w2 started first, b never counted.)
    assert eviction_order(cache) == labels("Sa2", "Sb1", "Sa1", "Sa", "S")


def test_index_keys_are_the_rule_s_values_after_each_call():
    """A call's end moves the next use of every class its agent reads (from "now", while the
    call was pending, to the predicted next read): the index must hold those nodes under their
    new keys. (It re-keyed only the ended agent's own class, and only when that class's earliest
    next use over all workflows moved: Sa1, read by w1's b call, kept "read now" until w1's
    next call and outranked every node predicted for later; swe, device only: 0.36 -> 0.69 of
    the oracle's gain.)"""
    cache, pol = two_workflows()
    for node in cache.candidates(Tier.DEVICE):
        assert node.key == pol.priority(node), node.blocks
    call(cache, pol, "Sb1x", 4.0, 1, "b", 2, context="w1")
    for node in cache.candidates(Tier.DEVICE):
        assert node.key == pol.priority(node), node.blocks


def test_one_step_value():
    cache, pol = two_workflows()
    v1 = {p: pol.scores.one_step(cache.tree.match(ids(p))[0]) for p in ["Sa1", "Sb1", "Sa2"]}
    assert v1 == pytest.approx({"Sa1": 0.8, "Sb1": 0.2, "Sa2": 0.0})


def test_retired_first_then_ascending_score_then_lru():
    cache, pol, _ = make({"w1": W1, "w2": W2})
    for w in (1, 2):
        pol.on_workflow_start(w, f"w{w}")
    call(cache, pol, "Sa1", 1.0, 1, "a", 0, context="w1")
    call(cache, pol, "Sc1", 2.0, 1, "c", 1, context="w1")   # agent c: predicted never again
    call(cache, pol, "Sa2", 3.0, 2, "a", 0, context="w2")
    call(cache, pol, "Sb2", 4.0, 2, "b", 1, context="w2")
    pol.on_workflow_end(2, cache.end_workflow(2))
    # Sa2/Sb2 are private to the ended w2: retired, gone first (LRU among them) although they
    # are the most recent; then w1's nodes by score (Sc1 = 0 < Sa1), then the common prefix.
    assert eviction_order(cache) == labels("Sa2", "Sb2", "Sc1", "Sa1", "Sa", "S")


def test_retired_ablation_is_lru_after_retired():
    cache, pol, _ = make({"w1": W1, "w2": W2}, policy="pbkv-retired")
    for w in (1, 2):
        pol.on_workflow_start(w, f"w{w}")
    call(cache, pol, "Sa1", 1.0, 1, "a", 0)
    call(cache, pol, "Sc1", 2.0, 1, "c", 1)
    call(cache, pol, "Sa2", 3.0, 2, "a", 0)
    pol.on_workflow_end(2, cache.end_workflow(2))
    assert eviction_order(cache) == labels("Sa2", "Sa1", "Sc1", "Sa", "S")


def test_shared_prefix_never_scores_below_its_descendants():
    cache, pol = two_workflows()
    for node in cache.tree.iter_nodes():
        for child in node.children.values():
            assert pol.scores.score(node) >= pol.scores.score(child) - 1e-12


def prefetch_setup(free, retired, budget):
    """Device: `retired` blocks of an ended workflow, 4 active blocks, `free` free blocks.
    Host: w1's two offloaded branches, predicted next (V1 .8) and later (V1 .2)."""
    device = 4 + retired + free
    cache, pol, _ = make({"w1": W1, "w2": W2}, device=device, host=50)
    for w in (1, 2):
        pol.on_workflow_start(w, f"w{w}")
    call(cache, pol, "XXa", 1.0, 1, "a", 0, context="w1")      # 3 blocks
    call(cache, pol, "YYb", 2.0, 1, "b", 1, context="w1")      # 3 blocks
    assert cache.evict(Tier.DEVICE, cache.evictable(Tier.DEVICE))  # both branches go to host
    active = call(cache, pol, "Q" * 4, 3.0, 1, "a", 2, context="w1")
    if retired:
        call(cache, pol, "R" * retired, 4.0, 2, "a", 0, context="w2")
        pol.on_workflow_end(2, cache.end_workflow(2))
    return cache, pol, active, budget


@pytest.mark.parametrize("free, retired, budget, want", [
    (0, 0, 100, 0),        # no free and no dead space: nothing, even with bandwidth
    (0, 3, 100, 3),        # retired space only: the best branch (XXa, 3 blocks) fits
    (6, 0, 100, 6),        # free space for both branches
    (6, 0, 3, 3),          # the link budget allows one branch only
])
def test_prefetch_uses_free_and_retired_space_only_within_budget(free, retired, budget, want):
    cache, pol, active, _ = prefetch_setup(free, retired, budget)
    active_before = {n.id for n in cache.tree.iter_nodes() if n.tier == Tier.DEVICE and not pol.scores.is_retired(n)}
    req = PrefetchRequest(budget * BLOCK, cache.free(Tier.DEVICE), 5.0)
    chosen = pol.prefetch(req)
    loaded = 0
    for node in chosen:
        seg = [n for n in node.path() if n.tier != Tier.DEVICE]
        move = cache.prepare_load(seg, keep_lock=False, allow_evict=pol.allow_evict_for_prefetch)
        assert move is not None
        cache.complete(move)
        loaded += move.tokens
    assert loaded == want * BLOCK
    assert loaded <= req.budget_tokens
    still = {n.id for n in cache.tree.iter_nodes() if n.tier == Tier.DEVICE}
    assert active_before <= still, "a prefetch evicted an active node"
    if chosen:
        assert chosen[0] is cache.tree.match(ids("XXa"))[0]  # ranked by one-step value
    cache.check()


def feed(pol, cache, agent_seq, wf, t0, context):
    pol.on_workflow_start(wf, f"w{wf}")
    for step, agent in enumerate(agent_seq):
        call(cache, pol, f"{wf:03d}{agent}", t0 + step, wf, agent, step, context=context)
    pol.on_workflow_end(wf, cache.end_workflow(wf))


def test_monitor_falls_back_to_lru_on_drift_and_recovers():
    # The predictor says "a, then b, then the end"; the stream is a -> b (right), then a -> c
    # (drift: the predictor is wrong, the online Markov baseline catches up), then a -> b again.
    ab = ([[0, 1, 0, 0], [0, 1, 0, 0]], [1.0, 0.0])
    end = ([[0, 1, 0, 0], [0, 1, 0, 0]], [0.0, 0.0])
    cache, pol, _ = make({"a": ab, "b": end, "c": end}, device=5000)
    wf = 0
    for _ in range(40):
        wf += 1
        feed(pol, cache, ["a", "b"], wf, wf * 10.0, None)
    assert pol.monitor.trust == 1.0 and pol.level == 10
    for _ in range(100):
        wf += 1
        feed(pol, cache, ["a", "c"], wf, wf * 10.0, None)
    assert pol.monitor.trust == 0.0 and pol.level == 0
    # at trust 0, active nodes are ranked by LRU alone
    assert pol.priority(cache.tree.match(ids(f"{wf:03d}a"))[0])[1] == 0
    assert pol.prefetch(PrefetchRequest(10**6, 10**6, 0.0)) == []
    for _ in range(250):
        wf += 1
        feed(pol, cache, ["a", "b"], wf, wf * 10.0, None)
    assert pol.monitor.trust == 1.0 and pol.level == 10


def test_retired_guard_turns_off_when_ended_cache_is_reused():
    cache, pol, _ = make({}, device=5000)
    # every call its own workflow, each extending the previous prompt (a chat split per turn)
    prompt = "p"
    for wf in range(1, 40):
        prompt += "q"
        pol.on_workflow_start(wf, f"w{wf}")
        call(cache, pol, prompt, float(wf), wf, "a", 0)
        pol.on_workflow_end(wf, cache.end_workflow(wf))
    assert pol.monitor.retired_reuse > 0.9 and not pol.monitor.retired_first
    last = cache.tree.match(ids(prompt))[0]
    assert pol.scores.is_retired(last) and pol.priority(last)[0] == 1  # no longer "retired first"


def _index_matches_priority(cache, pol, tier=Tier.DEVICE):
    """The eviction index's order equals the order the policy's current keys give."""
    stored = cache.candidates(tier)
    return stored == sorted(stored, key=lambda n: (pol.priority(n), n.id))


def test_retired_guard_flip_reranks_nodes_already_in_the_index():
    cache, pol, _ = make({}, device=5000)
    # workflows 1..4 end with private cache (retired, ranked first); then chat-like workflows
    # reuse ended cache until retired-first switches off: the early retired nodes, untouched
    # since, must leave class 0 at that moment (not keep their stale keys)
    for wf in range(1, 5):
        pol.on_workflow_start(wf, f"w{wf}")
        call(cache, pol, f"x{wf}", float(wf), wf, "a", 0)
        pol.on_workflow_end(wf, cache.end_workflow(wf))
    prompt, wf = "p", 4
    while pol.monitor.retired_first and wf < 100:
        wf += 1
        prompt += "q"
        pol.on_workflow_start(wf, f"w{wf}")
        call(cache, pol, prompt, float(wf), wf, "a", 0)
        pol.on_workflow_end(wf, cache.end_workflow(wf))
    early = cache.tree.match(ids("x1"))[0]
    assert pol.priority(early)[0] == 1 and _index_matches_priority(cache, pol)
    # fresh workflows that reuse nothing retired bring the guard back on: re-ranked again
    while not pol.monitor.retired_first and wf < 1000:
        wf += 1
        pol.on_workflow_start(wf, f"w{wf}")
        call(cache, pol, chr(0x4E00 + wf), float(wf), wf, "a", 0)   # a prompt of its own
        pol.on_workflow_end(wf, cache.end_workflow(wf))
    assert pol.priority(early)[0] == 0 and _index_matches_priority(cache, pol)


def test_unknown_agent_and_no_predictor_errors():
    cache, pol, pred = make({})
    pol.on_workflow_start(1, "w1")
    call(cache, pol, "Zz", 1.0, 1, "never-seen-agent", 0)
    node = cache.tree.match(ids("Zz"))[0]
    assert pol.scores.score(node) >= 0
    with pytest.raises(ValueError, match="needs a trained fused predictor"):
        make_cache(10, policy="pbkv", ctx=PolicyContext(block_size=BLOCK))


def test_perfect_predictor_and_policy_read_the_replayed_future():
    from pbkv.bench.run import RunConfig, Workload, simulate
    from pbkv.engine.profiles import load_profile
    from pbkv.policy.registry import needed_predictor, needs_future
    from pbkv.predict.perfect import PerfectPredictor
    from pbkv.workloads import generate, load_spec

    spec = load_spec("hover")
    wl = Workload("hover", generate(spec, 12, 0), spec.edges())
    calls = wl.workflows[0]
    pred = PerfectPredictor(wl.workflows, horizon=2).predict([c.agent for c in calls[:1]], calls[0].context)
    assert pred.top(1) == calls[1].agent and pred.top(2) == calls[2].agent
    assert list(pred.survival) == [1.0, 1.0]
    last = PerfectPredictor(wl.workflows, horizon=2).predict([c.agent for c in calls], calls[-1].context)
    assert list(last.survival) == [0.0, 0.0]
    assert needs_future("pbkv-perfect") and needed_predictor("pbkv-perfect") is None
    record = simulate(wl, RunConfig(policy="pbkv-perfect", concurrency=4, profile=load_profile("a6000-qwen3-32b"),
                                    cache=CacheConfig(device_tokens=20000, host_tokens=0)))
    assert record["calls"] == sum(map(len, wl.workflows)) and record["monitor_top1"] == 1.0


def test_perfect_predictor_tells_apart_workflows_that_share_history_and_context():
    """Two workflows start with the same agent and context and then part: looked up by history
    and context they are one key, so `pbkv-perfect` must look calls up by workflow and step."""
    from pbkv.bench.run import RunConfig, Workload, simulate
    from pbkv.engine.profiles import load_profile
    from pbkv.predict.perfect import PerfectPredictor
    from pbkv.trace import Call, Trace, TraceMeta

    def wf(name, agents, base):
        return [Call(name, s, a, 64 * (s + 1), 8, list(range(base, base + 4 * (s + 1))), context="same",
                     tool_wait=0.0)
                for s, a in enumerate(agents)]

    flows = [wf("a", ["plan", "search", "search"], 1000), wf("b", ["plan", "write", "judge"], 2000)]
    perfect = PerfectPredictor(flows, horizon=2)
    assert perfect.for_workflow("a", 0).top(1) == "search"
    assert perfect.for_workflow("b", 0).top(1) == "write" and perfect.for_workflow("b", 0).top(2) == "judge"
    assert perfect.predict(["plan"], "same").top(1) == "search"   # one key: the first workflow's
    trace = Trace(TraceMeta(block_size=16), flows[0] + flows[1])
    record = simulate(Workload("two", trace), RunConfig(policy="pbkv-perfect", concurrency=2,
                      profile=load_profile("a6000-qwen3-32b"), cache=CacheConfig(device_tokens=2000, host_tokens=0)))
    assert record["monitor_top1"] == 1.0   # every next agent foreseen, in both workflows


class SwapLearner:
    """An online learner whose retrain finishes when the test says (`ready`)."""

    def __init__(self):
        self.ready = None

    def add(self, history, contexts):
        pass

    def poll(self):
        ready, self.ready = self.ready, None
        return ready


def test_a_retrained_predictor_with_new_agents_is_used_for_every_active_workflow():
    """A retrain that learned new agents arrives while calls run: every stored prediction is made
    again with the new classes (a call ending under an old one read it by the new class indices:
    IndexError, and the server failed every call in flight)."""
    learner = SwapLearner()
    old = FakePredictor(["a"], 2, {"a": ([[0.9, 0.1], [0.5, 0.5]], [1.0, 0.5])})
    ctx = PolicyContext(block_size=BLOCK, predictors={"fused": old}, online_learner=learner)
    cache, pol = make_cache(100 * BLOCK, 0, policy="pbkv", ctx=ctx)
    for w in (1, 2, 3):
        pol.on_workflow_start(w, f"w{w}")
    call(cache, pol, "Sa1", 1.0, 1, "a", 0)
    call(cache, pol, "Sa2", 2.0, 2, "a", 0)
    call(cache, pol, "Sa3", 3.0, 3, "a", 0)
    _, running = arrive(cache, pol, "Sa1a", 4.0, 1, "a", 1)        # w1's second call is in progress
    new = FakePredictor(["a", "b", "c"], 2, {"a": ([[0.1, 0.8, 0.1, 0], [0.1, 0.1, 0.8, 0]], [1.0, 0.9])})
    learner.ready = new
    pol.on_workflow_end(3, cache.end_workflow(3))                   # the retrain lands as w3 ends
    assert pol.predictor is new and pol.scores.classes == ["a", "b", "c", "<unk>"]
    assert {w: len(p.agents) for w, p in pol.predictions.items()} == {1: 4, 2: 4}
    assert 3 not in pol.predictions                                 # the ending workflow is not predicted again
    leaf = put(cache, "Sa1a", 5.0, workflow=1, agent="a")
    pol.on_call_end(CallEvent(1, "a", 1, running, leaf, 5.0))     # raised IndexError
    call(cache, pol, "Sa2b", 6.0, 2, "b", 1)
    for node in cache.candidates(Tier.DEVICE):
        assert node.key == pol.priority(node), node.blocks
    cache.check()
