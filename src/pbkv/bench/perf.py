"""Speed figures: simulator throughput and eviction cost. Benchmarks, not tests."""

from __future__ import annotations

import random
import time

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig, Capacities, RadixTree, Tier, TieredCache
from pbkv.engine.profiles import load_profile
from pbkv.policy import CallEvent, PolicyContext, make_policy


def sim_speed(workload: str, workflows: int, concurrency: int, policy: str, predictor: str | None = None) -> dict:
    from pbkv.workloads import generate, load_spec
    spec = load_spec(workload)
    wl = Workload(workload, generate(spec, workflows, 0), spec.edges())
    predictors = _predictors(policy, predictor)
    start = time.perf_counter()  # batched predictions (as `pbkv bench` makes them) are timed too
    record = simulate(wl, RunConfig(policy=policy, concurrency=concurrency, profile=load_profile("a6000-qwen3-32b"),
                                    predictors=predictors))
    seconds = time.perf_counter() - start
    return {"calls": record["calls"], "seconds": seconds, "calls_per_minute": record["calls"] / seconds * 60}


def policy_overhead(workload: str, policy: str, predictor: str | None, workflows: int, concurrency: int,
                    cache: CacheConfig) -> dict:
    """Wall time of the policy's decisions (live predictions, one per call, on one torch thread)
    against the simulated makespan of the same run: what the policy would add to serving time."""
    from pbkv.workloads import generate, load_spec
    spec = load_spec(workload)
    wl = Workload(workload, generate(spec, workflows, 0), spec.edges())
    predictors = _predictors(policy, predictor)
    cfg = RunConfig(policy=policy, concurrency=concurrency, profile=load_profile("a6000-qwen3-32b"),
                    cache=cache, predictors=predictors, live_predictions=True)
    start = time.perf_counter()
    record = simulate(wl, cfg)
    return {"calls": record["calls"], "wall_seconds": time.perf_counter() - start,
            "policy_seconds": record["policy_seconds"], "makespan_s": record["makespan_s"],
            "us_per_call": record["policy_seconds"] / record["calls"] * 1e6,
            "overhead": record["policy_overhead"]}


def _predictors(policy: str, predictor: str | None) -> dict:
    from pbkv.bench.predictors import load
    from pbkv.policy.registry import needed_predictor
    variant = needed_predictor(policy)
    if variant and not predictor:
        raise ValueError(f"{policy} needs a predictor: pass --predictor DIR (saved by `pbkv train`)")
    return {variant: load(predictor)} if variant else {}


AGENTS = ["a0", "a1", "a2", "a3", "a4"]


def build_evict_tree(nodes: int, policy: str, seed: int = 0, model: str | None = None):
    """Build a tree of `nodes` device nodes (one-block prompts under 1,000 shared prefixes), each
    the call of a workflow: 100 lanes run workflows of ten calls over five agents back to back,
    and the policy hears every workflow start and end and every call start and end (predicting
    policies keep live predictions: from `model`, or a Markov predictor fitted on these
    workflows). Returns (cache, block size); the cache's policy is bound to it."""
    from pbkv.policy.registry import needed_predictor, needs_future
    rng = random.Random(seed)
    block, prefixes, lanes, length = 16, 1000, 100, 10
    plan = []  # (prefix, workflow, step)
    for i in range(nodes - prefixes):
        lane, rnd = i % lanes, i // lanes
        plan.append((rng.randrange(prefixes), (rnd // length) * lanes + lane, rnd % length))
    calls = _synthetic_calls(plan, prefixes, block)
    ctx = PolicyContext(block_size=block, agent_graph=_graph())
    variant = needed_predictor(policy)
    if variant:
        ctx.predictors = {variant: _predictors(policy, model)[variant] if model else _markov(calls)}
    if needs_future(policy):
        from pbkv.policy.future import Future
        ctx.future = Future(calls, block, lanes, lambda c: 1.0)
    pol = make_policy(policy, ctx)
    cache = TieredCache(RadixTree(block), Capacities(device=nodes * block * 2, host=0), pol)
    now = [0.0]
    pol.bind(cache, lambda: now[0])
    for p in range(prefixes):
        cache.reserve(block)
        cache.insert([p], block, float(p))
    for i, (p, w, step) in enumerate(plan):
        now[0] = float(prefixes + i)
        call = calls[w][step]
        if step == 0:
            pol.on_workflow_start(w, call.workflow_id)
        pol.on_call_start(CallEvent(w, call.agent, step, call, cache.tree.match(call.hash_ids)[0], now[0]))
        cache.reserve(block)
        leaf, _ = cache.insert(call.hash_ids, block, now[0])
        cache.tree.touch(leaf, now[0], w, call.agent)
        cache.refresh(leaf)
        pol.on_call_end(CallEvent(w, call.agent, step, call, leaf, now[0]))
        if step == len(calls[w]) - 1:
            pol.on_workflow_end(w, cache.end_workflow(w))
    assert len(cache.tree.index) == nodes
    return cache, block


def evict_speed(nodes: int, policy: str, seed: int = 0, model: str | None = None) -> dict:
    """Build the tree (`build_evict_tree`), then evict 10% of its nodes one eviction call at a
    time, as an engine under pressure does; only the evictions are timed."""
    from pbkv.policy.registry import needed_predictor
    cache, block = build_evict_tree(nodes, policy, seed, model)
    variant = needed_predictor(policy)
    evict = nodes // 10
    start_t = time.perf_counter()
    for _ in range(evict):
        cache.evict(Tier.DEVICE, block)
    seconds = time.perf_counter() - start_t
    return {"nodes": nodes, "evicted": evict, "seconds": seconds, "us_per_node": seconds / evict * 1e6,
            "predictor": (model or "markov (fitted on the synthetic workflows)") if variant else None}


def _synthetic_calls(plan, prefixes: int, block: int) -> list[list]:
    from pbkv.trace import Call
    calls: list[list] = [[] for _ in range(max(w for _, w, _ in plan) + 1)]
    for i, (p, w, step) in enumerate(plan):
        calls[w].append(Call(f"w{w}", step, AGENTS[step % len(AGENTS)], 2 * block, 1, [p, prefixes + i]))
    return calls


def _graph() -> dict[str, list[str]]:
    chain = ["START", *AGENTS, "END"]
    return {a: [b] for a, b in zip(chain, chain[1:])}


def _markov(calls):
    from pbkv.predict.markov import fit_markov_seqs
    return fit_markov_seqs([[c.agent for c in wf] for wf in calls], horizon=3)
