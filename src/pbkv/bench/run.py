"""One simulated run: a workload, a policy, a concurrency, a profile -> one flat result record."""

from __future__ import annotations

from dataclasses import dataclass, field

from pbkv.cache import CacheConfig, Capacities, CapacityDefaults, RadixTree, Tier, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.engine.cost import CostModel
from pbkv.engine.profiles import Profile
from pbkv.engine.simulator import Simulator
from pbkv.policy import PolicyContext, make_policy, needs_future
from pbkv.policy.future import Future
from pbkv.policy.step_graph import graph_from_sequences, static_sequence
from pbkv.trace import Call, Trace


@dataclass
class Workload:
    """What gets replayed: a trace's workflows plus the agent graph a developer would know."""

    name: str
    trace: Trace
    agent_graph: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self):
        self.workflows = list(self.trace.workflows().values())
        sequences = [[c.agent for c in w] for w in self.workflows]
        if not self.agent_graph:
            self.agent_graph = graph_from_sequences(sequences)
        self.static_sequence = static_sequence(sequences)


@dataclass
class RunConfig:
    """One run. `horizon` and `online_learner` go to the policy (`PolicyContext`);
    `live_predictions`: predict during the run (as a server does) instead of batched ahead."""

    policy: str
    concurrency: int | None          # None: open loop by trace `t`
    profile: Profile
    cache: CacheConfig = field(default_factory=CacheConfig)
    predictors: dict = field(default_factory=dict)   # variant -> trained predictor
    horizon: int | None = None       # None: the predictor's
    online_learner: object = None    # pbkv.predict.online.OnlineLearner
    live_predictions: bool = False

    def capacities(self) -> Capacities:
        """The simulator's capacities: unset ones from the profile."""
        p = self.profile
        return self.cache.resolve(CapacityDefaults(p.device_tokens, host_ratio=p.host_ratio, disk=p.disk_tokens))


def nominal_duration(cost: CostModel, concurrency: int | None) -> callable:
    """Rough seconds per call for the oracle's schedule: decode at a typical batch, no cache."""
    batch = concurrency or 16

    def duration(call: Call) -> float:
        step = cost.decode_step_seconds(batch, batch * call.input_length)
        return call.output_length * step + cost.prefill_seconds(cost.prefill_flops(call.input_length, 0)) * 0.2
    return duration


def check_fits(workload: Workload, device_tokens: int) -> None:
    for calls in workload.workflows:
        for c in calls:
            if c.input_length + c.output_length > device_tokens:
                raise ValueError(f"{workload.name}: call {c.workflow_id} step {c.step} needs "
                                 f"{c.input_length + c.output_length} tokens, more than the device "
                                 f"capacity of {device_tokens}; raise --device-tokens")


def simulate(workload: Workload, cfg: RunConfig, progress=None) -> dict:
    """Replay `workload` under `cfg`; return the summary record (see `Recorder.summary`)."""
    cost = CostModel(cfg.profile)
    caps = cfg.capacities()
    check_fits(workload, caps.device)
    predictors = cfg.predictors
    if predictors and not (cfg.online_learner or cfg.live_predictions):
        from pbkv.predict.cached import CachedPredictor  # same answers, batched ahead of the run
        predictors = {v: CachedPredictor(p, workload.workflows) for v, p in predictors.items()}
    ctx = PolicyContext(block_size=workload.trace.block_size, agent_graph=workload.agent_graph,
                        static_sequence=workload.static_sequence, horizon=cfg.horizon,
                        online_learner=cfg.online_learner, predictors=predictors)
    if needs_future(cfg.policy):
        ctx.future = Future(workload.workflows, workload.trace.block_size, cfg.concurrency,
                            nominal_duration(cost, cfg.concurrency))
    policy = make_policy(cfg.policy, ctx)
    cache = TieredCache(RadixTree(workload.trace.block_size), caps, policy)
    engine = Simulator(cost, cache, policy)
    recorder = Replay(engine, workload.workflows, cfg.concurrency, Recorder(), progress).run()
    record = recorder.summary()
    kv = cost.kv_bytes
    record.update({
        "bytes_loaded": kv * (cache.stats.loaded[Tier.HOST] + cache.stats.loaded[Tier.DISK]),
        "bytes_offloaded": kv * cache.stats.demoted[Tier.DEVICE],
        "prefetched_tokens": engine.stats.prefetched_tokens,
        "evictions": cache.stats.evictions,
        "device_tokens": caps.device,
        "host_tokens": caps.host,
        "disk_tokens": caps.disk,
        "prefill_seconds": engine.stats.prefill_seconds,
        "decode_seconds": engine.stats.decode_seconds,
        "policy_seconds": engine.stats.policy_seconds,
        "policy_overhead": engine.stats.policy_seconds / max(record["makespan_s"], 1e-9),
    })
    monitor = getattr(policy, "monitor", None)
    if monitor is not None:
        record.update(monitor.summary())
    return record
