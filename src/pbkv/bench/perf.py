"""Speed figures: simulator throughput and eviction cost. Benchmarks, not tests."""

from __future__ import annotations

import random
import time

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig, Capacities, RadixTree, Tier, TieredCache
from pbkv.engine.profiles import load_profile
from pbkv.policy import PolicyContext, make_policy


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


def evict_speed(nodes: int, policy: str, seed: int = 0) -> dict:
    """Build a tree of `nodes` device nodes (one-block prompts under 1,000 shared prefixes),
    then evict 10% of them one eviction call at a time, as an engine under pressure does."""
    rng = random.Random(seed)
    block = 16
    pol = make_policy(policy, PolicyContext(block_size=block, agent_graph={"START": ["a"]}))
    cache = TieredCache(RadixTree(block), Capacities(device=nodes * block * 2, host=0), pol)
    pol.bind(cache)
    prefixes = 1000
    next_id = prefixes
    for p in range(prefixes):
        cache.reserve(block)
        cache.insert([p], block, float(p))
    for i in range(nodes - prefixes):
        p = rng.randrange(prefixes)
        cache.reserve(block)
        cache.insert([p, next_id], block, float(prefixes + i))
        next_id += 1
    assert len(cache.tree.index) == nodes
    evict = nodes // 10
    start = time.perf_counter()
    for _ in range(evict):
        cache.evict(Tier.DEVICE, block)
    seconds = time.perf_counter() - start
    return {"nodes": nodes, "evicted": evict, "seconds": seconds, "us_per_node": seconds / evict * 1e6}
