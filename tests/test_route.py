"""Routers: exact choices on hand-built replica views, the registry, invariants for every router."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pbkv.route import (BadDecision, NoReplicas, ReplicaSnapshot, RouteDecision, RouteRequest, RouterConfig,
                        UnknownRouter, check_decision, make_router, router_class, router_names)
from pbkv.route.base import Router, reuse_hint, router_label
from pbkv.route.round_robin import RoundRobinRouter

CFG = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=1e-4, transfer_latency_s=0.01,
                   queue_s_per_request=0.5, load_penalty_tokens=100, block_size=16)


def req(wf="w", hash_ids=(1, 2, 3, 4, 5), tokens=80, **kw):
    return RouteRequest(workflow_id=wf, agent="a", hash_ids=tuple(hash_ids), input_tokens=tokens, **kw)


def view(name, load=0, blocks=(), workflows=None):
    return ReplicaSnapshot(name, load=load, blocks=frozenset(blocks), workflows=workflows or {})


def test_registry_names_and_errors():
    assert router_names() == ["round-robin", "least-load", "prefix", "sticky", "pbkv"]
    for name in router_names():
        assert make_router(name).name == name
    with pytest.raises(UnknownRouter, match=r"unknown router 'nope'; known routers: round-robin, least-load, "
                                            r"prefix, sticky, pbkv \(or 'package.module:Class'\)"):
        make_router("nope")
    assert router_class("pbkv.route.sticky:StickyRouter").name == "sticky"
    with pytest.raises(UnknownRouter, match="cannot load 'pbkv.route.sticky:Missing'"):
        router_class("pbkv.route.sticky:Missing")
    with pytest.raises(UnknownRouter, match="is not a pbkv Router subclass"):
        router_class("pbkv.route.base:RouterConfig")


def test_no_replicas():
    for name in router_names():
        with pytest.raises(NoReplicas):
            make_router(name).choose(req(), [])


def test_round_robin_cycles():
    r = make_router("round-robin")
    views = [view("a"), view("b"), view("c")]
    assert [r.choose(req(), views).replica for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_load_ties_go_to_the_first():
    assert make_router("least-load").choose(req(), [view("a", 2), view("b", 1), view("c", 1)]).replica == "b"


def test_prefix_trades_cached_tokens_against_load():
    views = [view("a", load=0), view("b", load=1, blocks=(1, 2, 3, 4))]   # b caches 64 of 80 tokens
    assert make_router("prefix", CFG).choose(req(), views).replica == "a"          # 64 - 100 < 0
    cheap = RouterConfig(load_penalty_tokens=50)
    assert make_router("prefix", cheap).choose(req(), views).replica == "b"        # 64 - 50 > 0
    # a chained prefix stops at the first missing block
    assert make_router("prefix", cheap).choose(req(), [view("a"), view("b", 1, blocks=(2, 3, 4))]).replica == "a"


def test_prefix_never_counts_the_last_prompt_token():
    views = [view("a", load=0), view("b", load=0, blocks=(1,))]
    d = make_router("prefix", CFG).choose(req(hash_ids=(1,), tokens=16), views)
    assert d.replica == "b" and "prefix 15 tokens" in d.reason


def test_sticky_follows_the_workflow_and_replaces_when_gone():
    r = make_router("sticky")
    assert r.choose(req("w1"), [view("a", 1), view("b", 0)]).replica == "b"
    assert r.choose(req("w1"), [view("a", 0), view("b", 5)]).replica == "b"
    assert r.choose(req("w2"), [view("a", 0), view("b", 5)]).replica == "a"
    d = r.choose(req("w1"), [view("a", 3), view("c", 1)])
    assert (d.replica, d.reason) == ("c", "placed again (b gone)")
    r.on_workflow_end("w1")
    assert r.choose(req("w1"), [view("a", 0), view("c", 1)]).replica == "a"


def test_pbkv_fetches_when_transfer_beats_recompute():
    views = [view("a", 0), view("b", 2, blocks=(1, 2, 3, 4), workflows={"w": 64})]
    d = make_router("pbkv", CFG).choose(req(), views)
    # a: fetch 64 tokens (0.0164 s) + recompute 16 (0.016 s); b: queue 2 x 0.5 s
    assert (d.replica, d.fetch_from, d.fetch_tokens) == ("a", "b", 64)


def test_pbkv_recomputes_when_the_link_is_slower_than_prefill():
    slow = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=2e-3, transfer_latency_s=0.01,
                        queue_s_per_request=0.5)
    views = [view("a", 0), view("b", 2, blocks=(1, 2, 3, 4), workflows={"w": 64})]
    d = make_router("pbkv", slow).choose(req(), views)
    assert (d.replica, d.fetch_from, d.fetch_tokens) == ("a", None, 0)


def test_pbkv_stays_home_when_queueing_is_cheap():
    views = [view("a", 0), view("b", 0, blocks=(1, 2, 3, 4), workflows={"w": 64})]
    d = make_router("pbkv", CFG).choose(req(), views)
    assert (d.replica, d.fetch_from) == ("b", None)


def test_pbkv_weighs_stranded_workflow_kv_by_predicted_reuse():
    cfg = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=1e-3, transfer_latency_s=0.01,
                       queue_s_per_request=0.5)
    # the workflow's home b holds 1000 tokens of another agent's context; this prompt is cached nowhere
    views = [view("a", 0), view("b", 1, workflows={"w": 1000})]
    r = make_router("pbkv", cfg)
    assert r.choose(req(reuse_probability=1.0), views).replica == "b"   # a: 0.08 + 1.0 > b: 0.5 + 0.08
    assert r.choose(req(reuse_probability=0.2), views).replica == "a"   # a: 0.08 + 0.2 < b: 0.58
    assert r.choose(req(), views).replica == "b"                        # unknown reuse counts as 1


def test_pbkv_places_a_new_workflow_where_fewest_workflows_live():
    # a caches the agent's prompt (64 of 80 tokens) but holds two workflows; b holds none
    a = view("a", 0, blocks=(1, 2, 3, 4), workflows={"x": 500, "y": 500})
    d = make_router("pbkv", CFG).choose(req("new"), [a, view("b", 0)])
    assert (d.replica, d.fetch_from, d.fetch_tokens) == ("b", "a", 64)   # and it fetches the prompt from a
    # equal counts: the call's own cost decides (a reuses 64 tokens)
    d = make_router("pbkv", CFG).choose(req("new"), [a, view("b", 0, workflows={"z": 10, "v": 10})])
    assert (d.replica, d.fetch_from) == ("a", None)
    # the count comes before the queue: b has fewer workflows but a long queue, it still gets the workflow
    assert make_router("pbkv", CFG).choose(req("new"), [a, view("b", 9)]).replica == "b"
    # one workflow more is tolerated: a holds one, b none, a's cached prompt decides (a retried chat
    # follows its prefix); with a long queue on a, b is cheaper again
    one = view("a", 0, blocks=(1, 2, 3, 4), workflows={"x": 500})
    assert make_router("pbkv", CFG).choose(req("new"), [one, view("b", 0)]).replica == "a"
    assert make_router("pbkv", CFG).choose(req("new"), [view("a", 9, blocks=(1, 2, 3, 4), workflows={"x": 500}),
                                                         view("b", 0)]).replica == "b"


def test_pbkv_keeps_a_known_workflow_home_whatever_the_counts():
    home = view("a", 0, blocks=(1, 2, 3, 4), workflows={"w": 64, "x": 500, "y": 500})
    assert make_router("pbkv", CFG).choose(req(), [home, view("b", 0)]).replica == "a"


def test_pbkv_warms_the_missing_part_of_the_next_prompt():
    views = [view("a", 0, blocks=(1, 2, 3, 4, 7))]
    d = make_router("pbkv", CFG).choose(req(next_prefix=(7, 8, 9)), views)
    assert d.warm == (8, 9)


def test_snapshot_round_trips_through_stats():
    v = view("a", 3, blocks=(5, 1), workflows={"w": 10})
    assert ReplicaSnapshot.from_stats(v.to_stats()) == v
    assert ReplicaSnapshot.from_stats({"blocks": [1]}, replica_id="x").cached_prefix_tokens([1, 2]) == 16


views_st = st.lists(st.tuples(st.integers(0, 5), st.sets(st.integers(1, 6)), st.integers(0, 300)),
                    min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(views_st, st.lists(st.integers(1, 6), min_size=1, max_size=6), st.floats(0, 1))
def test_every_router_keeps_the_decision_invariants(specs, prompt, p):
    views = [view(f"r{i}", load, blocks, {"w": t}) for i, (load, blocks, t) in enumerate(specs)]
    r = req(hash_ids=prompt, tokens=16 * len(prompt), reuse_probability=p)
    for name in router_names():
        router: Router = make_router(name, CFG)
        d = router.choose(r, views)
        ids = [v.id for v in views]
        assert d.replica in ids
        if d.fetch_from is not None:
            src, dst = views[ids.index(d.fetch_from)], views[ids.index(d.replica)]
            assert d.fetch_from != d.replica and d.fetch_tokens > 0
            assert src.cached_prefix_tokens(r.hash_ids) > dst.cached_prefix_tokens(r.hash_ids)
        assert router.choose(r, views).replica in ids
        check_decision(router, d, r, views)   # what the simulator's cluster checks


def test_ties_spread_new_workflows_to_the_replica_holding_fewer():
    views = [view("a", 0, workflows={"x": 10, "y": 10}), view("b", 0, workflows={"z": 10})]
    for name in ("least-load", "prefix", "sticky", "pbkv"):
        assert make_router(name, CFG).choose(req("new"), views).replica == "b", name


def test_pbkv_plans_no_transfer_when_replicas_cannot_fetch():
    views = [view("a", 0), view("b", 2, blocks=(1, 2, 3, 4), workflows={"w": 64})]
    cfg = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=1e-4, transfer_latency_s=0.01,
                       queue_s_per_request=0.5, can_fetch=False)
    d = make_router("pbkv", cfg).choose(req(), views)
    # a: recompute 80 (0.08) + strand 64 (0.064); b: queue 1.0 + recompute 16
    assert (d.replica, d.fetch_from) == ("a", None)


def test_pbkv_weighs_waiting_requests_not_running_ones_when_the_view_tells_them_apart():
    busy_home = view("b", 6, blocks=(1, 2, 3, 4), workflows={"w": 64})
    busy_home.queued = 0                      # six running, none waiting: joining the batch is cheap
    assert make_router("pbkv", CFG).choose(req(), [view("a", 0), busy_home]).replica == "b"
    busy_home.queued = 6
    assert make_router("pbkv", CFG).choose(req(), [view("a", 0), busy_home]).replica == "a"


class NeedsTwo(RoundRobinRouter):
    """Cannot be built from a config alone (loaded as `test_route:NeedsTwo`)."""

    def __init__(self, config, extra):
        super().__init__(config)


class HalfDone(Router):
    """Leaves `choose` abstract."""


@pytest.mark.parametrize("name", [".foo:Bar", ":", "a:b:c", "pbkv.route.sticky:", ":StickyRouter",
                                  "pbkv..route:X", "pbkv.route.sticky:Sticky Router", "1mod:X"])
def test_registry_refuses_odd_class_paths(name):
    with pytest.raises(UnknownRouter, match=rf"router {name!r}: .* is not 'package.module:Class'"):
        router_class(name)


def test_registry_refuses_classes_it_cannot_build():
    with pytest.raises(UnknownRouter, match=r"router 'pbkv.route.base:Router': pbkv.route.base:Router is abstract "
                                            r"\(does not implement choose\)"):
        router_class("pbkv.route.base:Router")
    with pytest.raises(UnknownRouter, match="test_route:HalfDone is abstract"):
        make_router("test_route:HalfDone")
    with pytest.raises(UnknownRouter, match=r"router 'test_route:NeedsTwo': test_route:NeedsTwo\(config, extra\) "
                                            r"cannot be built from a RouterConfig alone"):
        router_class("test_route:NeedsTwo")
    with pytest.raises(UnknownRouter, match="router name must be a string, got None"):
        router_class(None)
    assert isinstance(make_router("test_route:SpyLabel"), RoundRobinRouter)   # a well-formed one still loads


class SpyLabel(RoundRobinRouter):
    """Inherits round-robin's `name`: errors must not call it round-robin."""


def test_router_label_names_the_class_unless_it_names_itself():
    assert router_label(make_router("pbkv")) == "pbkv"
    assert router_label(SpyLabel()) == "test_route:SpyLabel"

    class Named(SpyLabel):
        name = "mine"
    assert router_label(Named()) == "mine"


def bad(replica="a", **kw):
    return RouteDecision(replica, **kw)


@pytest.mark.parametrize("decision, message", [
    (None, "choose returned None, not a RouteDecision"),
    (bad("-1"), r"replica '-1' is not one of the replicas it was given \('a', 'b'\)"),
    (bad("c"), "replica 'c' is not one of the replicas it was given"),
    (bad(0), "replica 0 is not one of the replicas"),
    (bad(fetch_from="z", fetch_tokens=16), "fetch_from 'z' is not one of the replicas it was given"),
    (bad(fetch_from="a", fetch_tokens=16), "fetch_from 'a' is the chosen replica itself"),
    (bad(fetch_from="b", fetch_tokens=-16), r"fetch_tokens -16 is not an int in \[0, 80\]"),
    (bad(fetch_from="b", fetch_tokens=81), r"fetch_tokens 81 is not an int in \[0, 80\]"),
    (bad(fetch_from="b", fetch_tokens=16.0), r"fetch_tokens 16.0 is not an int"),
    (bad(fetch_from="b", fetch_tokens=True), r"fetch_tokens True is not an int"),
    (bad(fetch_tokens=16), "fetch_tokens 16 without fetch_from"),
    (bad(warm="12"), "warm '12' is not a tuple of int block ids"),
    (bad(warm=(1, None)), r"warm \(1, None\) is not a tuple of int block ids"),
])
def test_check_decision_names_the_router_the_field_and_the_value(decision, message):
    with pytest.raises(BadDecision, match=r"^router test_route:SpyLabel: " + message):
        check_decision(SpyLabel(), decision, req(), [view("a"), view("b")])


def test_check_decision_accepts_every_well_formed_decision():
    views = [view("a"), view("b")]
    for d in (bad(), bad("b", fetch_from="a", fetch_tokens=80), bad(fetch_from="b", fetch_tokens=0),
              bad(warm=[3, 4]), bad(warm=(7,))):
        check_decision(make_router("pbkv"), d, req(), views)
    assert issubclass(BadDecision, ValueError)   # the CLI reports it as a one-line error


@pytest.mark.parametrize("hint", ["0.5", -1e9, 1e9, -0.01, 1.01, math.nan, math.inf, -math.inf, True, False,
                                  None, [0.5], {"p": 0.5}])
def test_a_reuse_hint_that_is_not_a_probability_counts_as_unknown(hint):
    """Routing hints come from clients: whatever they send, the router decides as without it."""
    cfg = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=1e-3, transfer_latency_s=0.01,
                       queue_s_per_request=0.5)
    views = [view("a", 0), view("b", 1, workflows={"w": 1000})]
    unknown = make_router("pbkv", cfg).choose(req(), views)
    assert req(reuse_probability=hint).reuse_probability is None
    assert make_router("pbkv", cfg).choose(req(reuse_probability=hint), views) == unknown
    sneaked = req()
    object.__setattr__(sneaked, "reuse_probability", hint)   # a request built without the check
    assert make_router("pbkv", cfg).choose(sneaked, views) == unknown


def test_a_valid_reuse_hint_is_kept_as_given():
    for p in (0, 0.0, 0.2, 1, 1.0, Fraction(1, 3)):
        assert req(reuse_probability=p).reuse_probability is p
        assert reuse_hint(p) is p
