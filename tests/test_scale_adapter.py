"""The Ray-free half of the Ray Serve router: hints from requests, reports merged with the overlay."""

from __future__ import annotations

from pbkv.route import ReplicaSnapshot, RouteRequest, RouterConfig, make_router
from pbkv.scale.adapter import Overlay, measured_config, route_request


def test_route_request_finds_the_hints_dict():
    assert route_request(["plain text"], {}) is None
    r = route_request([], {"body": {"workflow_id": 7, "agent": "coder", "hash_ids": [1, "2"], "input_tokens": 20,
                                    "next_prefix": [9]}})
    assert r == RouteRequest("7", "coder", (1, 2), 20, next_prefix=(9,))
    assert route_request([{"workflow_id": "w", "hash_ids": [1, 2, 3]}]).input_tokens == 48


def test_overlay_remembers_routed_calls_until_the_second_report_after_them():
    o = Overlay()
    req = RouteRequest("w", "a", (1, 2), 30, output_tokens=5)
    report = ReplicaSnapshot("x", load=2, blocks=frozenset({9})).to_stats() | {"seq": 1}
    assert o.view("x", report, None).cached_prefix_tokens([9]) == 16
    o.routed("x", req)
    v = o.view("x", report, load=0)
    assert v.cached_prefix_tokens([1, 2, 9, 3]) == 48 and v.workflow_tokens("w") == 35 and v.load == 0
    assert v.workflow_count == 1
    # the next report may have been taken before the call reached the replica: the call stays
    v = o.view("x", report | {"seq": 2}, None)
    assert (v.cached_prefix_tokens([1, 2]), v.workflow_tokens("w"), v.workflow_count, v.load) == (32, 35, 1, 2)
    o.routed("x", RouteRequest("v", "a", (5,), 16))
    v = o.view("x", report | {"seq": 3}, None)                      # the second report after it: gone
    assert (v.cached_prefix_tokens([1]), v.cached_prefix_tokens([9]), v.workflow_tokens("w")) == (0, 16, 0)
    assert (v.cached_prefix_tokens([5]), v.workflow_count) == (16, 1)   # the later call is kept one more
    assert o.view("x", report | {"seq": 3}, None).cached_prefix_tokens([5]) == 16   # same seq: nothing moves
    y = o.view("y", None, None)
    assert (y.id, y.load, y.workflow_count, y.cached_prefix_tokens([1])) == ("y", 0, 0, 0)


def test_overlay_is_bounded():
    o = Overlay(max_blocks=3)
    o.routed("x", RouteRequest("w", "a", (1, 2), 32))
    o.routed("x", RouteRequest("v", "a", (3, 4), 32))
    assert o.recent["x"].blocks == {3, 4} and o.recent["x"].workflows == {"v": 32}
    o.view("x", {"seq": 1}, None)
    o.view("x", {"seq": 2}, None)                                   # {3, 4} now the older generation
    o.routed("x", RouteRequest("u", "a", (5, 6), 32))               # 2 + 2 > 3: both cleared first
    assert (o.recent["x"].blocks, "x" in o.older) == ({5, 6}, False)


def test_a_workflow_follows_its_first_call_before_any_report():
    o, router = Overlay(), make_router("pbkv")
    first = RouteRequest("w", "a", (1, 2, 3), 48)
    views = [o.view(r, {}, 0) for r in ("r0", "r1")]
    assert router.choose(first, views).replica == "r0"
    o.routed("r0", first)
    o.routed("r1", RouteRequest("other", "a", (7,), 16))
    second = RouteRequest("w", "a", (1, 2, 3, 4), 64)
    assert router.choose(second, [o.view(r, {}, 0) for r in ("r1", "r0")]).replica == "r0"


def test_a_request_without_reuse_probability_takes_the_one_its_home_replica_reported():
    from pbkv.route import RouterConfig
    from pbkv.scale.adapter import with_reported_reuse
    # as test_route's stranded-KV case, but the probability comes from b's report, not the client
    cfg = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=1e-3, transfer_latency_s=0.01,
                       queue_s_per_request=0.5)
    o = Overlay()
    a = ReplicaSnapshot("a").to_stats() | {"seq": 1}
    b = ReplicaSnapshot("b", load=1, workflows={"w": 1000}, reuse={"w": 0.2}).to_stats() | {"seq": 1}
    assert ReplicaSnapshot.from_stats(b).reuse == {"w": 0.2}
    views = [o.view("a", a, None), o.view("b", b, None)]
    req = RouteRequest("w", "x", (1, 2, 3, 4, 5), 80)
    assert with_reported_reuse(req, views).reuse_probability == 0.2
    assert make_router("pbkv", cfg).choose(req, views).replica == "b"           # unknown: counts as 1
    assert make_router("pbkv", cfg).choose(with_reported_reuse(req, views), views).replica == "a"
    sent = RouteRequest("w", "x", (1,), 16, reuse_probability=0.9)
    assert with_reported_reuse(sent, views) is sent                              # the client's own wins
    other = RouteRequest("v", "x", (1,), 16)
    assert with_reported_reuse(other, views) is other                            # no replica holds v
    b_silent = ReplicaSnapshot("b", workflows={"w": 1000}).to_stats()
    assert with_reported_reuse(req, [o.view("b2", b_silent, None)]) is req       # nothing reported


def test_a_decision_to_fetch_is_written_into_the_call_s_hints_and_a_pin_is_read():
    from pbkv.route import RouteDecision
    from pbkv.scale.adapter import hints_dict, mark_fetch, pinned
    o = Overlay()
    a = ReplicaSnapshot("a", blocks=frozenset({1})).to_stats() | {"seq": 1}
    b = ReplicaSnapshot("b", load=3, blocks=frozenset({1, 2, 3, 4}), workflows={"w": 64}).to_stats() | {"seq": 1}
    views = [o.view("a", a, None), o.view("b", b, None)]
    hints = {"workflow_id": "w", "hash_ids": [1, 2, 3, 4, 5], "input_tokens": 80, "fetch": {"stale": 1}}
    assert hints_dict(["text", hints], {}) is hints
    decision = make_router("pbkv").choose(route_request([hints]), views)      # b is busy: a, fetching from b
    assert (decision.replica, decision.fetch_from, decision.fetch_tokens) == ("a", "b", 48)
    mark_fetch(hints, decision, views)
    assert hints["fetch"] == {"from": "b", "first": 1, "blocks": 3}            # a holds block 1 already
    mark_fetch(hints, RouteDecision("b"), views)
    assert "fetch" not in hints                                                # none now: the old one goes
    assert pinned([{"pin": "b"}, [1, 2]]) == "b" and pinned([hints]) is None and pinned([], {"x": {"pin": 7}}) == "7"


def test_measured_costs_are_the_median_of_what_replicas_report_and_the_config_stands_elsewhere():
    base = RouterConfig(prefill_s_per_token=1e-3, transfer_s_per_token=2e-6, queue_s_per_request=0.01)
    assert measured_config(base, [None, {}, {"costs": {}}]) is base
    stats = [{"costs": {"prefill_s_per_token": 3e-5}}, {"costs": {"prefill_s_per_token": 5e-5}},
             {"costs": {"prefill_s_per_token": 1e-5, "transfer_s_per_token": 4e-7}},
             {"costs": {"prefill_s_per_token": 0.0, "transfer_s_per_token": "fast"}}]   # not rates: ignored
    cfg = measured_config(base, stats)
    assert (cfg.prefill_s_per_token, cfg.transfer_s_per_token) == (3e-5, 4e-7)
    assert (cfg.queue_s_per_request, cfg.can_fetch) == (0.01, True)
    assert base.prefill_s_per_token == 1e-3                       # a copy: the configured costs stay


def test_a_hints_dict_ends_its_workflow_only_when_it_says_done():
    from pbkv.scale.adapter import hinted_call
    from pbkv.scale.failover import route_hints
    assert hinted_call([route_hints("w", "a", [1], 16, 4)]).done is False
    assert hinted_call([route_hints("w", "a", [1], 16, 4, done=True)]).done is True
    assert hinted_call([{"workflow_id": "w", "hash_ids": [1], "done": "yes"}]).done is False   # malformed: no


def test_a_workflow_ended_by_its_endpoint_is_forgotten_by_this_process_routers_of_that_app():
    from dataclasses import dataclass
    from pbkv.scale import adapter

    @dataclass(eq=False)
    class Router:   # the Ray router's face `workflow_ended` reads
        app_name: str
        pbkv_router: object

    mine, other = Router("app1", make_router("sticky")), Router("app2", make_router("sticky"))
    for r in (mine, other):
        adapter.register_router(r)
        r.pbkv_router.home["w"] = "a"
    adapter.workflow_ended("app1", "w")
    assert "w" not in mine.pbkv_router.home and other.pbkv_router.home == {"w": "a"}


def test_sticky_remembers_at_most_max_workflows_the_least_recently_routed_forgotten_first():
    r = make_router("sticky")
    r.max_workflows = 3
    views = [ReplicaSnapshot("a", 0.0, frozenset(), {}, 16)]
    for w in ("w0", "w1", "w2"):
        r.choose(RouteRequest(w, "", (), 16), views)
    r.choose(RouteRequest("w0", "", (), 16), views)      # w0 routed again: now the most recent
    r.choose(RouteRequest("w3", "", (), 16), views)
    assert list(r.home) == ["w2", "w0", "w3"]
