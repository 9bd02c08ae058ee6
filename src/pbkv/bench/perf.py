"""Speed figures: simulator throughput and eviction cost. Benchmarks, not tests."""

from __future__ import annotations

import os
import random
import time

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig, Capacities, RadixTree, Tier, TieredCache
from pbkv.engine.profiles import load_profile
from pbkv.policy import CallEvent, PolicyContext, make_policy


def sim_speed(workload: str, workflows: int, concurrency: int, policy: str, predictor: str | None = None,
              note=None) -> dict:
    """`note(line)`, before the run, for each note on the replayed agents `predictor` never saw
    (as `pbkv bench --predictor` prints them)."""
    from pbkv.workloads import generate, load_spec
    from pbkv.workloads.spec_files import spec_source
    spec = load_spec(workload)
    wl = Workload(workload, generate(spec, workflows, 0, spec_source(workload)), spec.edges())
    predictors = _predictors(policy, predictor)
    _agent_notes(predictors, predictor, wl, note)
    start = time.perf_counter()  # batched predictions (as `pbkv bench` makes them) are timed too
    record = simulate(wl, RunConfig(policy=policy, concurrency=concurrency, profile=load_profile("a6000-qwen3-32b"),
                                    predictors=predictors))
    seconds = time.perf_counter() - start
    return {"calls": record["calls"], "seconds": seconds, "calls_per_minute": record["calls"] / seconds * 60}


def policy_overhead(workload: str, policy: str, predictor: str | None, workflows: int, concurrency: int,
                    cache: CacheConfig, note=None) -> dict:
    """Wall time of the policy's decisions (live predictions, one per call, on one torch thread)
    against the simulated makespan of the same run: what the policy would add to serving time.
    `note` as for `sim_speed`."""
    from pbkv.workloads import generate, load_spec
    from pbkv.workloads.spec_files import spec_source
    spec = load_spec(workload)
    wl = Workload(workload, generate(spec, workflows, 0, spec_source(workload)), spec.edges())
    predictors = _predictors(policy, predictor)
    _agent_notes(predictors, predictor, wl, note)
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
    if not variant:
        return {}
    from pbkv.predict.base import require_variant
    loaded = load(predictor)
    require_variant(loaded, variant, policy, f"--predictor {predictor}")
    return {variant: loaded}


def _agent_notes(predictors: dict, path: str | None, wl: Workload, note) -> None:
    """`note(line)` when the workload calls agents the given predictor never saw: the line
    `pbkv bench` prints (`pbkv.bench.predictors.agent_notes`)."""
    from pbkv.predict.evaluate import unseen_note
    if note is None or path is None:
        return
    for predictor in predictors.values():
        text = unseen_note(set(predictor.agents), wl.trace)
        if text:
            note(f"note: {wl.name}: --predictor {path}: {text}")


AGENTS = ["a0", "a1", "a2", "a3", "a4"]


def _evict_predictor(policy: str, model: str):
    """--predictor for `perf evict`: its synthetic workflows call agents a0..a4 only, so a
    predictor that does not know them all would predict every call as the unknown agent while
    the figure names it: refused (ValueError)."""
    loaded = _predictors(policy, model)
    predictor = next(iter(loaded.values()))
    unknown = [a for a in AGENTS if a not in set(predictor.agents)]
    if unknown:
        raise ValueError(f"--predictor {model}: perf evict's synthetic workflows call agents {', '.join(AGENTS)}, "
                         f"and this predictor never saw {', '.join(unknown)}: every such prediction would be the "
                         f"unknown agent's; leave --predictor out (a Markov predictor fitted on the synthetic "
                         f"workflows is used)")
    return loaded


def evict_speed(nodes: int, policy: str, seed: int = 0, model: str | None = None) -> dict:
    """Eviction cost per evicted node in a full tree of `nodes` device nodes with live workflows.

    The tree (`EvictBench`): one-block prompts under 1,000 shared prefixes, each the call of a
    workflow; 100 lanes run workflows of ten calls over five agents back to back (each lane's
    first workflow is five calls long, so every lane is mid-workflow at any moment), and the
    policy hears every workflow start and end and every call start and end (predicting policies
    keep live predictions: from `model`, or a Markov predictor fitted on these workflows). The
    device holds exactly the tree. Then the lanes go on for `nodes // 10` more calls, as an
    engine under pressure does: each call's new block must first evict one node (the timed
    part: `make_room`, with the re-ranking the cache does as nodes leave), so the tree stays at
    `nodes` nodes and predictions keep moving. The policy's own per-call work (predictions,
    re-ranking after them) is not timed here: `perf policy` measures that."""
    bench = EvictBench(nodes, policy, seed, model)
    seconds = 0.0
    for i in range(nodes - bench.prefixes, nodes - bench.prefixes + nodes // 10):
        seconds += bench.call(i)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    evict = bench.cache.stats.evictions  # one per call, two when a call's prefix had been evicted too
    return {"nodes": nodes, "evicted": evict, "seconds": seconds, "us_per_node": seconds / evict * 1e6, "load": load,
            "predictor": (model or "markov (fitted on the synthetic workflows)") if bench.variant else None}


class EvictBench:
    """The engine's part in `evict_speed`: a tree of `nodes` nodes built by live workflows."""

    prefixes, lanes, length, block = 1000, 100, 10, 16

    def __init__(self, nodes: int, policy: str, seed: int = 0, model: str | None = None):
        from pbkv.policy.registry import needed_predictor, needs_future
        self.variant = needed_predictor(policy)
        given = _evict_predictor(policy, model) if self.variant and model else None   # before building
        rng = random.Random(seed)
        self.plan = [(rng.randrange(self.prefixes), *self._slot(i)) for i in range(nodes - self.prefixes + nodes // 10)]
        self.calls = _synthetic_calls(self.plan, self.prefixes, self.block)
        ctx = PolicyContext(block_size=self.block, agent_graph=_graph())
        if self.variant:
            ctx.predictors = {self.variant: given[self.variant] if given else _markov(self.calls)}
        if needs_future(policy):
            from pbkv.policy.future import Future
            ctx.future = Future(self.calls, self.block, self.lanes, lambda c: 1.0)
        self.policy = pol = make_policy(policy, ctx)
        self.cache = TieredCache(RadixTree(self.block), Capacities(device=nodes * self.block, host=0), pol)
        self.now = 0.0
        pol.bind(self.cache, lambda: self.now)
        for p in range(self.prefixes):
            self.cache.reserve(self.block)
            self.cache.insert([p], self.block, float(p))
        for i in range(nodes - self.prefixes):
            self.call(i)
        assert len(self.cache.tree.index) == nodes and self.cache.free(Tier.DEVICE) == 0

    def _slot(self, i: int) -> tuple[int, int]:
        """(workflow, step) of the plan's call i: lane i % lanes; a lane's first workflow has
        half the length of the others."""
        lane, rnd = i % self.lanes, i // self.lanes
        half = self.length // 2
        nth, step = (0, rnd) if rnd < half else ((rnd - half) // self.length + 1, (rnd - half) % self.length)
        return nth * self.lanes + lane, step

    def call(self, i: int) -> float:
        """Serve the plan's call i as an engine does; return the CPU seconds spent making room
        (this thread's CPU time: other processes sharing the cores do not count)."""
        _, w, step = self.plan[i]
        cache, pol, tree = self.cache, self.policy, self.cache.tree
        self.now = float(self.prefixes + i)
        call = self.calls[w][step]
        if step == 0:
            pol.on_workflow_start(w, call.workflow_id)
        node, matched = tree.match(call.hash_ids)
        pol.on_call_start(CallEvent(w, call.agent, step, call, node, self.now))
        if matched:
            tree.lock(node)  # the matched path is in use: never evicted to make room for the call
        new = self.block * (len(call.hash_ids) - matched)
        start = time.thread_time()
        room = cache.reserve(new)
        seconds = time.thread_time() - start
        assert room, "the bench's tree has no evictable node"
        leaf, _ = cache.insert(call.hash_ids, self.block, self.now)
        if matched:
            tree.unlock(node)
        tree.touch(leaf, self.now, w, call.agent)
        cache.refresh(leaf)
        pol.on_call_end(CallEvent(w, call.agent, step, call, leaf, self.now))
        if step == (self.length // 2 if w < self.lanes else self.length) - 1:  # not where the plan stops
            pol.on_workflow_end(w, cache.end_workflow(w))
        return seconds


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
