"""One bench run, whatever the engine: predictors -> policy -> TieredCache -> engine -> driver -> record.

`run_workload` is the one place a run is put together. The simulated run (`run.py` `simulate`)
and the real-engine run (`hf_run.py` `run_hf`) differ only in the `EngineSetup` they pass: how
capacities are resolved, the oracle's rough duration of a call, the engine object, and the
record fields only that engine has. Everything else (which predictors a policy gets, the
oracle's schedule, the cache, the driver, the shared figures of the record) is the same code.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pbkv.cache import Capacities, RadixTree, Tier, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.policy import Policy, PolicyContext, make_policy, needs_future
from pbkv.policy.future import Future
from pbkv.trace import Call

if TYPE_CHECKING:
    from pbkv.bench.run import RunConfig, Workload


class EngineSetup(ABC):
    """What one engine brings to a run. Subclasses set `kv_bytes_per_token` and implement
    `capacities`, `call_seconds` and `make_engine`; `close` and `record` are optional."""

    kv_bytes_per_token: float
    # whether calls can fail inside this engine (ended with "error"): then the record has
    # `failed_calls` (and, when some failed, `first_error`); the simulator's records have neither
    reports_failed_calls: bool = False

    @abstractmethod
    def capacities(self, workload: Workload, cfg: RunConfig) -> Capacities:
        """Device/host/disk tokens for this run (each engine has its own defaults)."""

    @abstractmethod
    def call_seconds(self, call: Call) -> float:
        """A rough duration of `call`, for the oracle's schedule (`policy.future.Future`)."""

    def token_costs(self) -> tuple[float | None, float | None]:
        """Seconds to recompute one token and to load one back from host (None: unknown; the
        policies that weigh them use their defaults)."""
        return None, None

    @abstractmethod
    def make_engine(self, cache: TieredCache, policy: Policy):
        """The engine serving this run over `cache` (it binds `policy`)."""

    def close(self, engine) -> None:
        """Release what the engine holds (files, threads); called even when the run failed."""

    def record(self, engine, cache: TieredCache, wall_seconds: float) -> dict:
        """Figures only this engine has, added to the record (`wall_seconds`: the replay's)."""
        return {}


def check_fits(workload: Workload, device_tokens: int) -> None:
    """Every call must fit on the device alone (prompt + outputs), else the run can never end."""
    for calls in workload.workflows:
        for c in calls:
            if c.input_length + c.output_length > device_tokens:
                raise ValueError(f"{workload.name}: call {c.workflow_id} step {c.step} needs "
                                 f"{c.input_length + c.output_length} tokens, more than the device "
                                 f"capacity of {device_tokens}; raise --device-tokens")


def policy_predictors(workload: Workload, cfg: RunConfig) -> dict:
    """The trained predictors the policy gets. Their answers are batched ahead of the run
    (`CachedPredictor`: the same answers, computed once) unless predictions must be made live:
    an online learner changes the model as the run goes, and `live_predictions` (perf) measures
    what making them costs."""
    predictors = cfg.predictors
    if predictors and not (cfg.online_learner or cfg.live_predictions):
        from pbkv.predict.cached import CachedPredictor
        predictors = {v: CachedPredictor(p, workload.workflows) for v, p in predictors.items()}
    return predictors


def build_policy(workload: Workload, cfg: RunConfig, setup: EngineSetup) -> Policy:
    """`cfg.policy` built for `workload`: its block size, agent graph, predictors, horizon, learner and,
    for policies that see the future (the oracle), the schedule `setup.call_seconds` implies."""
    recompute, load = setup.token_costs()
    ctx = PolicyContext(block_size=workload.trace.block_size, agent_graph=workload.agent_graph,
                        static_sequence=workload.static_sequence, horizon=cfg.horizon,
                        online_learner=cfg.online_learner, recompute_token_seconds=recompute,
                        load_token_seconds=load,
                        predictors=policy_predictors(workload, cfg))
    if needs_future(cfg.policy):
        ctx.future = Future(workload.workflows, workload.trace.block_size, cfg.concurrency, setup.call_seconds)
    return make_policy(cfg.policy, ctx)


def run_workload(workload: Workload, cfg: RunConfig, setup: EngineSetup, progress=None) -> dict:
    """Replay `workload` under `cfg` on the engine `setup` makes; the flat result record
    (`Recorder.summary` plus the cache's and the engine's figures). `progress` is called with
    the number of finished workflows."""
    caps = setup.capacities(workload, cfg)
    check_fits(workload, caps.device)
    policy = build_policy(workload, cfg, setup)
    cache = TieredCache(RadixTree(workload.trace.block_size), caps, policy)
    engine = setup.make_engine(cache, policy)
    start = time.perf_counter()
    try:
        recorder = Replay(engine, workload.workflows, cfg.concurrency, Recorder(), progress).run()
    finally:
        setup.close(engine)
    wall = time.perf_counter() - start
    record = recorder.summary()
    s = engine.stats
    record.update({
        "bytes_offloaded": setup.kv_bytes_per_token * cache.stats.demoted[Tier.DEVICE],
        "prefetched_tokens": s.prefetched_tokens, "evictions": cache.stats.evictions,
        "device_tokens": caps.device, "host_tokens": caps.host, "disk_tokens": caps.disk,
        "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds, "decode_steps": s.decode_steps,
        "policy_seconds": s.policy_seconds,
        "policy_overhead": s.policy_seconds / max(record["makespan_s"], 1e-9),
    })
    record.update(setup.record(engine, cache, wall))
    if setup.reports_failed_calls:
        record["failed_calls"] = recorder.failed
        if recorder.failed:
            record["first_error"] = recorder.first_error
    monitor = getattr(policy, "monitor", None)
    if monitor is not None:
        record.update(monitor.summary())
    return record
