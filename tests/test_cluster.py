"""Several simulated instances behind a router (`pbkv bench --instances N --router ...`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pbkv.bench.cluster_run import simulate_cluster
from pbkv.bench.run import RunConfig, simulate
from pbkv.bench.sweep import Source, load_workload
from pbkv.cache import CacheConfig
from pbkv.cli import app
from pbkv.engine.profiles import load_profile
from pbkv.policy.registry import needed_predictor
from pbkv.predict.markov import fit_markov_seqs
from pbkv.route import BadDecision, RouteDecision
from pbkv.route.round_robin import RoundRobinRouter
from pbkv.scale.links import Link, get_link

WL = Source(name="hover", spec="hover", workflows=24, seed=0)


def cfg(policy="lru", concurrency=8):
    return RunConfig(policy=policy, concurrency=concurrency, profile=load_profile("a6000-qwen3-32b"),
                     cache=CacheConfig(20000, 20000, 100000))


def test_one_instance_cluster_is_the_plain_simulator_exactly():
    one = simulate(load_workload(WL), cfg())
    for router in ("round-robin", "pbkv"):
        c = simulate_cluster(load_workload(WL), cfg(), 1, router, get_link("pcie4"))
        assert {k: c[k] for k in one if k not in ("policy_seconds", "policy_overhead")} == \
               {k: v for k, v in one.items() if k not in ("policy_seconds", "policy_overhead")}
        assert (c["instances"], c["router"], c["bytes_moved_between_instances"]) == (1, router, 0.0)


def timed(workload, gap: float):
    """`workload` replayed open loop: workflow i arrives at i * gap seconds."""
    for i, calls in enumerate(workload.workflows):
        calls[0].t = i * gap
    return workload


@pytest.mark.parametrize("policy", ["lru", "kvflow", "scalesim"])
def test_one_instance_behind_a_router_is_the_plain_open_loop_record(policy):
    """Open loop, arrivals that land during prefill passes and decode runs: the cluster and the
    plain engine stamp and order them alike (events fire in order of their own time)."""
    run = cfg(policy, concurrency=None)
    one = simulate(timed(load_workload(WL), 3.0), run)
    c = simulate_cluster(timed(load_workload(WL), 3.0), run, 1, "sticky", get_link("pcie4"))
    skip = ("policy_seconds", "policy_overhead")
    assert {k: c[k] for k in one if k not in skip} == {k: v for k, v in one.items() if k not in skip}


def test_a_call_routed_to_an_instance_mid_decode_joins_at_the_next_step():
    """Round-robin sends short's second call (issued at ~0.37 s) to the instance decoding long's
    2,000 tokens: it joins that batch at the next step, as on one instance, not when the ~79 s
    run ends (the instance's decode run stops where another instance may send it a call)."""
    from pbkv.bench.run import Workload
    from pbkv.trace import Call, Trace, TraceMeta
    calls = [Call("long", 0, "a", 16, 2000, [1], t=0.0), Call("short", 0, "a", 32, 10, [100, 101], t=0.0),
             Call("short", 1, "a", 48, 1, [100, 101, 102], tool_wait=0.0)]
    run = cfg("lru", concurrency=None)
    one = simulate(Workload("t", Trace(TraceMeta(block_size=16), calls)), run)
    two = simulate_cluster(Workload("t", Trace(TraceMeta(block_size=16), calls)), run, 2, "round-robin",
                           get_link("pcie4"))
    assert two["mean_workflow_latency_s"] == pytest.approx(one["mean_workflow_latency_s"], rel=0.002)
    assert two["p99_ttft_s"] < 0.1


@pytest.mark.parametrize("router, shared", [("round-robin", 10**6), ("least-load", 0)])
def test_a_call_issued_during_a_prefill_pass_sees_the_instances_as_they_are_then(router, shared):
    """P's 8,000-token prefill runs from 0 to ~2.1 s on instance 0; Q (P's prompt + one block) is
    issued at 0.5 s. P's KV does not exist yet: Q cannot read it from the shared tier, and
    least-load sees instance 0 busy. Q recomputes on instance 1, as fast as P (it read P's
    blocks at 0.5 s and least-load queued it behind P: the pass's effects were visible early)."""
    from pbkv.bench.run import Workload
    from pbkv.trace import Call, Trace, TraceMeta
    calls = [Call("P", 0, "a", 8000, 1, list(range(500)), t=0.0),
             Call("Q", 0, "a", 8016, 1, list(range(501)), t=0.5)]
    r = simulate_cluster(Workload("t", Trace(TraceMeta(block_size=16), calls)), cfg(concurrency=None), 2, router,
                         get_link("pcie4"), shared_tokens=shared, shared_link=get_link("nvme"))
    assert not shared or r["shared_tier_reads"] == 0
    assert r["recomputed_tokens"] == 8000 + 8016 and r["p99_ttft_s"] > 2


def test_reads_from_the_shared_tier_queue_on_its_one_device():
    """X and Y, on two idle instances, read P's 2,000-token prefix from the shared tier at once:
    the second read waits for the first (one NVMe device), not both at the full bandwidth."""
    from pbkv.bench.run import Workload
    from pbkv.engine.cost import CostModel
    from pbkv.trace import Call, Trace, TraceMeta
    p = list(range(125))
    calls = [Call("P", 0, "a", 2000, 1, p, t=0.0), Call("X", 0, "a", 2016, 1, p + [900], t=1.0),
             Call("Y", 0, "a", 2016, 1, p + [901], t=1.0)]
    r = simulate_cluster(Workload("t", Trace(TraceMeta(block_size=16), calls)), cfg(concurrency=None), 3,
                         "round-robin", get_link("pcie4"), shared_tokens=10**5, shared_link=get_link("nvme"))
    cost = CostModel(load_profile("a6000-qwen3-32b"))
    first = cost.prefill_seconds(cost.prefill_flops(2000, 0))
    rest = cost.prefill_seconds(cost.prefill_flops(16, 2000))
    read = get_link("nvme").seconds(2000 * cost.kv_bytes)
    assert r["shared_tier_reads"] == 2
    assert r["mean_ttft_s"] == pytest.approx((first + (read + rest) + (2 * read + rest)) / 3, rel=1e-4)


@pytest.mark.parametrize("router, concurrency", [("round-robin", 12), ("least-load", None), ("pbkv", 6)])
def test_no_decode_run_passes_a_call_routed_to_its_instance_by_more_than_a_step(monkeypatch, router, concurrency):
    """Whenever a call reaches an instance at time T, no decode run of that instance that began
    before T ended more than one step after T (`Simulator.horizon`, `quiet_until`)."""
    from pbkv.engine.simulator import Simulator
    runs, late = {}, []
    decode, submit = Simulator._decode_round, Simulator.submit

    def logged_decode(self):
        start, dt = self.now, self._step_seconds()
        decode(self)
        runs.setdefault(id(self), []).append((start, self.now, dt))

    def checked_submit(self, req):
        t = req.arrival if req.arrival is not None else self.now
        late.extend((s, e, t) for s, e, dt in runs.get(id(self), []) if s < t and e - t > dt * (1 + 1e-9))
        submit(self, req)
    monkeypatch.setattr(Simulator, "_decode_round", logged_decode)
    monkeypatch.setattr(Simulator, "submit", checked_submit)
    wl = load_workload(WL) if concurrency else timed(load_workload(WL), 2.0)
    simulate_cluster(wl, cfg(concurrency=concurrency), 3, router, get_link("pcie4"))
    assert runs and not late


def test_one_pbkv_instance_reports_the_plain_records_monitor_readings():
    wl = load_workload(WL)
    run = cfg("pbkv")
    run.predictors = {needed_predictor("pbkv"): fit_markov_seqs([[c.agent for c in w] for w in wl.workflows], horizon=3)}
    one = simulate(load_workload(WL), run)
    c = simulate_cluster(load_workload(WL), run, 1, "sticky", get_link("pcie4"))
    keys = ("monitor_samples", "monitor_top1", "monitor_baseline_top1", "trust", "retired_reuse")
    assert all(k in one for k in keys) and {k: c[k] for k in keys} == {k: one[k] for k in keys}
    two = simulate_cluster(load_workload(WL), run, 2, "sticky", get_link("pcie4"))
    assert two["monitor_samples"] > 0 and 0 <= two["monitor_top1"] <= 1 and 0 <= two["trust"] <= 1


@pytest.mark.parametrize("router", ["round-robin", "least-load", "prefix", "sticky", "pbkv"])
def test_every_call_is_served_once_and_every_token_accounted(router):
    wl = load_workload(WL)
    r = simulate_cluster(wl, cfg(), 3, router, get_link("pcie4"))
    calls = [c for w in wl.workflows for c in w]
    assert (r["workflows"], r["calls"], r["prompt_tokens"]) == (24, len(calls), sum(c.input_length for c in calls))
    hit = (r["device_hit_rate"] + r["host_hit_rate"] + r["disk_hit_rate"]) * r["prompt_tokens"]
    assert round(hit) + r["recomputed_tokens"] == r["prompt_tokens"]
    if router == "sticky":
        assert r["workflow_moves"] == 0
    assert (r["kv_fetches"] == 0) == (r["bytes_moved_between_instances"] == 0)
    if router != "pbkv":
        assert r["kv_fetches"] == 0


def test_fetching_over_a_link_costs_time_and_counts_bytes():
    wl = load_workload(WL)
    fast = simulate_cluster(wl, cfg(concurrency=16), 2, "pbkv", Link("fast", 1e6, 0.0))
    slow = simulate_cluster(wl, cfg(concurrency=16), 2, "pbkv", Link("slow", 1e-3, 1.0))
    assert fast["kv_fetches"] > 0 and fast["bytes_moved_between_instances"] > 0
    assert slow["kv_fetches"] == 0        # a link slower than recomputing is never used


def test_bench_cli_compares_routers_side_by_side(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--workload", "hover", "--workflows", "12", "--concurrency", "4",
                                 "--policies", "lru,arc", "--instances", "2,3", "--router", "round-robin,pbkv",
                                 "--device-tokens", "40000", "--out", str(tmp_path), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "on 2 instances (pcie4 links)" in r.output and "on 3 instances (pcie4 links)" in r.output
    assert "x rr" in r.output and "wf/min" in r.output
    records = json.loads((tmp_path / "bench.json").read_text())
    # one table per instance count; no oracle behind a router (each instance's oracle would see all calls)
    assert [(x["instances"], x["router"], x["policy"]) for x in records] == [
        (2, "round-robin", "lru"), (2, "round-robin", "arc"), (2, "pbkv", "lru"), (2, "pbkv", "arc"),
        (3, "round-robin", "lru"), (3, "round-robin", "arc"), (3, "pbkv", "lru"), (3, "pbkv", "arc")]
    assert all("bytes_moved_between_instances" in x for x in records)
    assert all(("speedup_vs_lru" in x) == (x["policy"] == "arc") for x in records)


def test_bench_cli_router_errors(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--instances", "2", "--router", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown router 'nope'" in r.output
    r = CliRunner().invoke(app, ["bench", "--instances", "2", "--link", "carrier-pigeon", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown link 'carrier-pigeon'" in r.output
    r = CliRunner().invoke(app, ["bench", "--instances", "2", "--engine", "hf", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--engine sim" in r.output
    r = CliRunner().invoke(app, ["bench", "--instances", "2,0", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--instances: expected positive integers, comma-separated, got '2,0'" in r.output


def test_router_costs_come_from_the_profile():
    """Queueing: one decode step of the clients per instance at the mean prompt (no tuned share)."""
    from pbkv.bench.cluster_run import router_config
    from pbkv.engine.cost import CostModel
    wl, cost = load_workload(WL), CostModel(load_profile("a6000-qwen3-32b"))
    calls = [c for w in wl.workflows for c in w]
    mean = sum(c.input_length for c in calls) // len(calls)
    rc = router_config(cost, wl, get_link("pcie4"), 4, batch=6)
    assert rc.queue_s_per_request == cost.decode_step_seconds(6, 6 * mean)
    assert rc.prefill_s_per_token == cost.prefill_seconds(cost.prefill_flops(mean, 0)) / mean
    assert rc.transfer_s_per_token == pytest.approx(cost.kv_bytes / (25e9 * 4), rel=1e-5)


def test_a_shared_tier_lets_any_instance_reuse_what_another_computed():
    wl = load_workload(WL)
    plain = simulate_cluster(wl, cfg(), 4, "round-robin", get_link("pcie4"))
    shared = simulate_cluster(wl, cfg(), 4, "round-robin", get_link("pcie4"), shared_tokens=10**6,
                              shared_link=get_link("nvme"))
    assert shared["shared_tier_reads"] > 0 and shared["bytes_from_shared_tier"] > 0
    assert shared["bytes_to_shared_tier"] > 0 and shared["shared_tier_tokens"] == 10**6
    assert shared["recomputed_tokens"] < plain["recomputed_tokens"]
    assert "shared_tier_reads" not in plain
    # round-robin never fetches from a peer: a shared read that found no room is not a failed fetch
    assert shared["kv_fetches"] == 0 and shared["kv_fetch_failed"] == 0
    assert 0 <= shared["shared_tier_reads_failed"] <= shared["shared_tier_reads"]


def test_every_figure_of_a_cluster_run_reaches_the_json():
    """Before: `shared_tier_reads_failed` (documented) was computed and then dropped from
    bench.json, while `bytes_from_shared_tier` still counted the failed reads' bytes."""
    from pbkv.bench.sweep import INTERNAL_KEYS, RECORD_KEYS, finish_records
    r = simulate_cluster(load_workload(WL), cfg(), 2, "round-robin", get_link("pcie4"), shared_tokens=10**6,
                         shared_link=get_link("nvme"))
    assert set(r) - set(RECORD_KEYS) <= set(INTERNAL_KEYS)
    assert set(simulate(load_workload(WL), cfg())) - set(RECORD_KEYS) <= set(INTERNAL_KEYS)
    assert "shared_tier_reads_failed" in finish_records([{**r, "workload": "hover", "policy": "lru",
                                                          "concurrency": 8}])[0]


def test_bench_cli_shared_tier_needs_instances(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--shared-tokens", "1000", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--shared-tokens needs --instances" in r.output


SEEN: list = []   # (workflow id, reuse_probability) of every request `SpyRouter` placed


class SpyRouter(RoundRobinRouter):
    """Round-robin that records what each request told it (loaded as `test_cluster:SpyRouter`)."""

    def choose(self, request, replicas):
        SEEN.append((request.workflow_id, request.reuse_probability))
        return super().choose(request, replicas)


def test_the_router_hears_the_instances_predicted_reuse():
    # pbkv instances tell the router P(the workflow calls again after this call), from the
    # prediction of the instance that ran its latest call; LRU instances predict nothing
    wl = load_workload(WL)
    SEEN.clear()
    simulate_cluster(wl, cfg(), 2, "test_cluster:SpyRouter", get_link("pcie4"))
    assert {p for _, p in SEEN} == {None}
    SEEN.clear()
    predicting = cfg("pbkv")
    predicting.predictors = {needed_predictor("pbkv"): fit_markov_seqs([[c.agent for c in w] for w in wl.workflows], horizon=3)}
    simulate_cluster(wl, predicting, 2, "test_cluster:SpyRouter", get_link("pcie4"))
    first = {}
    for wf, p in SEEN:
        first.setdefault(wf, p)
    assert set(first.values()) == {None}                 # a workflow's first call: nothing predicted yet
    later = [p for _, p in SEEN if p is not None]
    assert len(later) == len(SEEN) - len(first)          # every later call got a prediction
    assert all(0.0 <= p <= 1.0 for p in later) and min(later) < 1.0


class MinusOne(RoundRobinRouter):
    """Out-of-tree routers that break `RouteDecision`'s invariants (loaded as `test_cluster:...`)."""

    def choose(self, request, replicas):
        return RouteDecision("-1")


class OutOfRange(RoundRobinRouter):
    def choose(self, request, replicas):
        return RouteDecision(str(len(replicas) + 3))


class SelfFetch(RoundRobinRouter):
    def choose(self, request, replicas):
        return RouteDecision(replicas[0].id, fetch_from=replicas[0].id, fetch_tokens=16)


class NegativeFetch(RoundRobinRouter):
    def choose(self, request, replicas):
        return RouteDecision(replicas[0].id, fetch_from=replicas[-1].id, fetch_tokens=-10**6)


class HugeFetch(RoundRobinRouter):
    def choose(self, request, replicas):
        return RouteDecision(replicas[0].id, fetch_from=replicas[-1].id, fetch_tokens=request.input_tokens + 1)


class FetchFromNowhere(RoundRobinRouter):
    """Well-formed, but asks instance 1 (never given a call, so it holds nothing) for the prompt."""

    def choose(self, request, replicas):
        return RouteDecision(replicas[0].id, fetch_from=replicas[-1].id, fetch_tokens=request.input_tokens)


@pytest.mark.parametrize("router, message", [
    ("MinusOne", r"replica '-1' is not one of the replicas it was given \('0', '1'\)"),
    ("OutOfRange", r"replica '5' is not one of the replicas it was given"),
    ("SelfFetch", r"fetch_from '0' is the chosen replica itself"),
    ("NegativeFetch", r"fetch_tokens -1000000 is not an int in \[0, \d+\]"),
    ("HugeFetch", r"fetch_tokens \d+ is not an int in \[0, \d+\]"),
])
@pytest.mark.parametrize("shared", [0, 10**6])
def test_the_cluster_refuses_a_bad_decision_naming_the_router(router, message, shared):
    with pytest.raises(BadDecision, match=rf"^router test_cluster:{router}: {message}"):
        simulate_cluster(load_workload(WL), cfg(), 2, f"test_cluster:{router}", get_link("pcie4"),
                         shared_tokens=shared)


def test_a_router_cannot_fetch_kv_the_source_does_not_hold():
    r = simulate_cluster(load_workload(WL), cfg(), 2, "test_cluster:FetchFromNowhere", get_link("pcie4"))
    assert (r["kv_fetches"], r["bytes_moved_between_instances"]) == (0, 0.0)


def test_bench_cli_reports_bad_routers_as_usage_errors(tmp_path):
    base = ["bench", "--workload", "hover", "--workflows", "4", "--concurrency", "2", "--policies", "lru",
            "--instances", "2", "--jobs", "1", "--out", str(tmp_path), "--router"]
    for router, message in [("test_cluster:MinusOne", "router test_cluster:MinusOne: replica '-1' is not one"),
                            ("pbkv.route.base:Router", "pbkv.route.base:Router is abstract"),
                            (".foo:Bar", "'.foo:Bar' is not 'package.module:Class'"),
                            (":", "':' is not 'package.module:Class'")]:
        r = CliRunner().invoke(app, base + [router])
        assert r.exit_code == 2 and message in " ".join(r.output.split()), (router, r.output)
