"""The peers as policies (SLRU, ARC, Continuum, ScaleSim): exact eviction orders on small trees."""

from helpers import BLOCK, ids, make_cache, put
from pbkv.cache import Tier
from pbkv.policy import CallEvent, PolicyContext
from pbkv.policy.invocation import InvocationDistance
from pbkv.trace import Call


def eviction_order(cache, tier=Tier.DEVICE):
    order = []
    original = cache.rules.on_evict
    cache.rules.on_evict = lambda node, src, dst: (order.append(node.blocks[-1]), original(node, src, dst))
    while cache.evict(tier, 1):
        pass
    return order


def labels(*prompts):
    return [ids(p)[-1] for p in prompts]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def call(cache, pol, prompt, now, wf=None, agent="x", step=0, clock=None):
    """One call as an engine makes it: start (matched prefix), insert + touch, end."""
    if clock is not None:
        clock.now = now
    c = Call(f"w{wf}", step, agent, len(prompt) * BLOCK, 1, ids(prompt))
    node, _ = cache.tree.match(c.hash_ids)
    pol.on_call_start(CallEvent(wf, agent, step, c, node, now))
    leaf = put(cache, prompt, now, workflow=wf, agent=agent)
    pol.on_call_end(CallEvent(wf, agent, step, c, leaf, now))
    return leaf


# ------------------------------------------------------------------ SLRU

def test_slru_evicts_probation_before_protected():
    cache, pol = make_cache(100 * BLOCK, policy="slru")
    call(cache, pol, "k", 0.0)
    call(cache, pol, "k", 1.0)   # second access: protected
    call(cache, pol, "m", 2.0)
    call(cache, pol, "n", 3.0)
    # LRU would evict k first (last used at 1); SLRU keeps the node used twice.
    assert eviction_order(cache) == labels("m", "n", "k")


def test_slru_split_upper_part_counts_both_users():
    cache, pol = make_cache(100 * BLOCK, policy="slru")
    call(cache, pol, "pq", 0.0)
    call(cache, pol, "pr", 1.0)  # splits "p" off "pq": p was used by both calls
    call(cache, pol, "s", 2.0)
    # pq and pr were used once each, p twice: probation pq, pr, s (LRU), then the leafless p.
    assert eviction_order(cache) == labels("pq", "pr", "s", "p")


def test_slru_ranks_host_tier_the_same_way():
    cache, pol = make_cache(10 * BLOCK, host=10 * BLOCK, policy="slru")
    call(cache, pol, "u", 0.0)
    call(cache, pol, "u", 1.0)
    call(cache, pol, "v", 2.0)
    call(cache, pol, "w", 3.0)
    assert eviction_order(cache) == labels("v", "w", "u")      # all three written down to host
    assert eviction_order(cache, Tier.HOST) == labels("v", "w", "u")  # LRU there: u, v, w


# ------------------------------------------------------------------ ARC

def test_arc_starts_as_lru_and_protects_frequent_nodes_once_victims_have_an_age():
    clock = Clock()
    cache, pol = make_cache(100 * BLOCK, policy="arc")
    pol.bind(cache, clock)
    call(cache, pol, "a", 0.0, clock=clock)
    call(cache, pol, "a", 1.0, clock=clock)   # frequent (T2)
    call(cache, pol, "b", 2.0, clock=clock)
    call(cache, pol, "c", 3.0, clock=clock)
    # no victim yet: no age, no bonus -> LRU order among a (1), b (2), c (3)
    assert [n.blocks[-1] for n in cache.candidates(Tier.DEVICE)] == labels("a", "b", "c")
    clock.now = 11.0
    cache.evict(Tier.DEVICE, 1)               # evicts a (age 10): the mean victim age is 10
    assert pol.tiers[Tier.DEVICE].age == 10.0
    call(cache, pol, "d", 11.0, clock=clock)
    call(cache, pol, "d", 12.0, clock=clock)  # T2 with bonus f x age = 0.5 x 10 = 5 -> key 17
    call(cache, pol, "e", 13.0, clock=clock)  # T1, key 13
    assert eviction_order(cache) == labels("b", "c", "e", "d")


def test_arc_ghost_hits_move_the_target_like_arc_moves_p():
    clock = Clock()
    cache, pol = make_cache(3 * BLOCK, policy="arc")
    pol.bind(cache, clock)
    state = pol.tiers[Tier.DEVICE]
    call(cache, pol, "g", 0.0, clock=clock)
    call(cache, pol, "h", 1.0, clock=clock)
    call(cache, pol, "h", 2.0, clock=clock)
    call(cache, pol, "i", 3.0, clock=clock)
    call(cache, pol, "j", 4.0, clock=clock)   # full: g (T1) is evicted, a B1 ghost
    assert labels("g")[0] in state.ghosts[0]
    f = state.f
    call(cache, pol, "g", 5.0, clock=clock)   # B1 hit: recency was wanted, f (T2's bonus) falls
    assert state.f < f and labels("g")[0] not in state.ghosts[0]


# ------------------------------------------------------------------ Continuum

def test_continuum_pins_a_paused_workflow_until_its_ttl_expires():
    clock = Clock()
    ctx = PolicyContext(block_size=BLOCK, recompute_token_seconds=0.1)
    cache, pol = make_cache(100 * BLOCK, policy="continuum", ctx=ctx)
    pol.bind(cache, clock)
    pol.on_workflow_start(1, "w1")
    # learn agent x's pauses: 2 s after each call
    for t in (0.0, 2.0, 4.0):
        call(cache, pol, "q" * (1 + int(t)), t, wf=1, agent="x", step=int(t), clock=clock)
    assert pol.ttl("x") == 2.0   # tau* = 2 s (every pause); calls take no time: no allowance
    call(cache, pol, "z", 4.5, clock=clock)                        # no workflow: not pinned
    # The workflow's path (q..qqqqq, pinned until 6) ranks after z although z is newer.
    assert eviction_order(cache) == labels("z", "qqqqq", "qqq", "q")


def test_continuum_expired_pins_fall_back_to_lru_order():
    clock = Clock()
    cache, pol = make_cache(100 * BLOCK, policy="continuum")
    pol.bind(cache, clock)
    pol.on_workflow_start(1, "w1")
    call(cache, pol, "r", 0.0, wf=1, agent="x", clock=clock)       # cold start: TTL 1 s
    call(cache, pol, "t", 0.5, clock=clock)
    assert [n.blocks[-1] for n in cache.candidates(Tier.DEVICE)] == labels("t", "r")
    clock.now = 1.5
    pol.prefetch(None)                                             # an engine event: r's pin expired
    assert [n.blocks[-1] for n in cache.candidates(Tier.DEVICE)] == labels("r", "t")


def test_continuum_does_not_pin_when_pauses_outlast_the_reload_cost():
    clock = Clock()
    ctx = PolicyContext(block_size=BLOCK, recompute_token_seconds=1e-6)
    cache, pol = make_cache(10 * BLOCK, policy="continuum", ctx=ctx)
    pol.bind(cache, clock)
    pol.pauses["x"] = [30.0, 60.0]
    assert pol.ttl("x") == 0.0


# ------------------------------------------------------------------ ScaleSim

GRAPH = {"START": ["a"], "a": ["b"], "b": ["c"], "c": ["END"]}


def test_invocation_distance_from_the_graph_and_observations():
    d = InvocationDistance(GRAPH, horizon=5)
    assert d.from_last("a") == {"b": 1.0, "c": 2.0}
    for _ in range(16):        # observed: after a, about half the time a again, half b
        d.observe("a", "a")
        d.observe("a", "b")    # (32 observations: the tables are rebuilt)
    p_loop = 16 / 33           # with the graph's seed count of a -> b
    got = d.from_last("a")
    assert abs(got["b"] - sum(p_loop ** k for k in range(5))) < 1e-9       # E[min(T_b, 5)]
    assert abs(got["a"] - (1 + 4 * 17 / 33)) < 1e-9   # a again only by looping at once


def test_scalesim_evicts_farthest_invocation_first():
    loop = {"START": ["a"], "a": ["b"], "b": ["a", "c"], "c": ["END"]}
    cache, pol = make_cache(100 * BLOCK, policy="scalesim", ctx=PolicyContext(block_size=BLOCK, agent_graph=loop))
    for wf in (1, 2):
        pol.on_workflow_start(wf, f"w{wf}")
    t = 0.0
    for agent, fixed in (("a", "A"), ("b", "B")):
        for wf in (1, 2):
            t += 1
            call(cache, pol, fixed + str(wf), t, wf=wf, agent=agent)
    # Both workflows last ran b; b -> a or c, half each; c -> END. Expected calls until each
    # agent runs (horizon 5): c 2.5, a 3, b 3.5. Farthest first: b's nodes, then a's (LRU
    # would evict a's first).
    assert pol.wf_dist[1] == {"a": 3.0, "b": 3.5, "c": 2.5}
    assert eviction_order(cache) == labels("B1", "B2", "B", "A1", "A2", "A")


def test_scalesim_prefetches_the_nearest_agents_nodes():
    cache, pol = make_cache(10 * BLOCK, host=10 * BLOCK, policy="scalesim",
                            ctx=PolicyContext(block_size=BLOCK, agent_graph=GRAPH))
    for wf in (1, 2):
        pol.on_workflow_start(wf, f"w{wf}")
    call(cache, pol, "P1", 1.0, wf=1, agent="b")
    call(cache, pol, "P2", 2.0, wf=2, agent="b")  # P is shared by two workflows' agent b
    call(cache, pol, "Q1", 3.0, wf=1, agent="a")
    call(cache, pol, "Q2", 4.0, wf=2, agent="a")  # both ran a last: b is next, a far
    assert cache.evict(Tier.DEVICE, cache.usage[Tier.DEVICE])   # everything written to host
    # b's nodes, one call away: the deeper ones first (loading one loads its path)
    assert [n.blocks[-1] for n in pol.prefetch(None)] == labels("P1", "P2", "P")


def test_perf_evict_runs_every_policy_with_live_workflows():
    from pbkv.bench.perf import evict_speed
    from pbkv.policy import policy_names
    for name in ["lru", "kvflow", "oracle", "pbkv", "continuum", "scalesim", "arc", "slru"]:
        assert name in policy_names()
        r = evict_speed(1500, name)
        assert 150 <= r["evicted"] <= 300 and r["us_per_node"] > 0  # two when a call's prefix went too
        assert (r["predictor"] is not None) == (name == "pbkv")
