"""One instance behind any router is the plain simulator exactly (docs/scale-out.md): the same
record apart from the router's fields, and the same policy hooks, in the same order, with the
same arguments, so that prefetching policies (pbkv) decide alike."""

from __future__ import annotations

import pytest

from pbkv.bench.cluster_run import simulate_cluster
from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.bench.sweep import Source, load_workload
from pbkv.cache import CacheConfig
from pbkv.engine.base import EngineBase
from pbkv.engine.profiles import load_profile
from pbkv.policy.registry import needed_predictor
from pbkv.predict.markov import fit_markov_seqs
from pbkv.scale.links import get_link
from pbkv.trace import Call, Trace, TraceMeta

ROUTERS = ("round-robin", "least-load", "prefix", "sticky", "pbkv")
ROUTER_FIELDS = {"instances", "router", "link", "bytes_moved_between_instances", "kv_fetches", "kv_fetch_failed",
                 "workflow_moves", "max_instance_share", "policy_seconds", "policy_overhead"}


def hand_workload() -> Workload:
    """Three workflows. q0 (p0's prompt + one block) is issued 0.3 s into p0's ~1 s prefill
    pass, so on a plain engine its `on_call_start` sees p0's blocks (the pass ended before the
    engine looked at the call). r starts mid-run, 0.5 s before its call: with two clients when
    p ends, open loop at 0.6 s, during p0's pass (a plain engine hears of it after the pass)."""
    p = list(range(250))
    calls = [Call("p", 0, "a", 4000, 1, p, t=0.0),
             Call("q", 0, "b", 4016, 30, p + [900], t=0.0, tool_wait=0.3),
             Call("q", 1, "a", 4048, 8, p + [900, 901, 902], tool_wait=0.1),
             Call("r", 0, "b", 4032, 12, p + [950, 951], t=0.6, tool_wait=0.5),
             Call("r", 1, "c", 300, 4, [960 + i for i in range(19)], tool_wait=0.2)]
    return Workload("hand", Trace(TraceMeta(block_size=16), calls))


def run_config(policy: str, workload: Workload, device: int, concurrency: int | None) -> RunConfig:
    run = RunConfig(policy=policy, concurrency=concurrency, profile=load_profile("a6000-qwen3-32b"),
                    cache=CacheConfig(device, 20000, 100000))
    if needed_predictor(policy):
        agents = [[c.agent for c in w] for w in workload.workflows]
        run.predictors = {needed_predictor(policy): fit_markov_seqs(agents, horizon=3)}
    return run


def logging_hooks(monkeypatch) -> list:
    """Every policy hook call from now on, as (hook, engine time, its arguments in brief)."""
    log, timed = [], EngineBase._timed

    def brief(a):
        if hasattr(a, "call"):       # a CallEvent
            return a.workflow, a.step, a.node.id, a.now
        if hasattr(a, "budget_tokens"):
            return a.budget_tokens, a.free_tokens, a.now
        return [n.id for n in a] if isinstance(a, list) else getattr(a, "id", a)

    def logged(self, hook, *args):
        out = timed(self, hook, *args)
        log.append((hook.__name__, self.now, [brief(a) for a in args],
                    [n.id for n in out] if hook.__name__ == "prefetch" else None))
        return out
    monkeypatch.setattr(EngineBase, "_timed", logged)
    return log


def plain_and_routed(make, run: RunConfig, log: list) -> list[tuple[str, dict, dict, list]]:
    """(router, the plain record, the routed record, whether the hooks matched) per router."""
    plain = simulate(make(), run)
    hooks = log[:]
    out = []
    for router in ROUTERS:
        log.clear()
        routed = simulate_cluster(make(), run, 1, router, get_link("pcie4"))
        out.append((router, plain, routed, log == hooks))
    return out


def same_record(plain: dict, routed: dict) -> dict:
    """The fields where `routed` differs from `plain`, the router's own fields aside."""
    return {k: (v, routed.get(k)) for k, v in plain.items() if k not in ROUTER_FIELDS and routed.get(k) != v}


@pytest.mark.parametrize("concurrency", [2, None])
@pytest.mark.parametrize("policy", ["pbkv", "pbkv-retired", "lru", "kvflow", "scalesim", "oracle"])
def test_one_instance_hears_the_plain_runs_policy_hooks(monkeypatch, policy, concurrency):
    log = logging_hooks(monkeypatch)
    run = run_config(policy, hand_workload(), 9000, concurrency)
    for router, plain, routed, hooks_match in plain_and_routed(hand_workload, run, log):
        assert hooks_match, router
        assert not same_record(plain, routed), router
        assert (routed["instances"], routed["router"]) == (1, router)


def test_one_pbkv_instance_prefetches_as_the_plain_run():
    """The tester's case, smaller: hover under memory pressure, where pbkv prefetches; before,
    calls issued during a prefill pass reached the instance before the pass's blocks did, and
    the prefetches (and so hits, evictions, bytes) came out differently."""
    make = lambda: load_workload(Source(name="hover", spec="hover", workflows=12, seed=0))  # noqa: E731
    run = run_config("pbkv", make(), 8000, 6)
    plain = simulate(make(), run)
    assert plain["prefetched_tokens"] > 0
    for router in ("round-robin", "pbkv"):
        assert not same_record(plain, simulate_cluster(make(), run, 1, router, get_link("pcie4"))), router
