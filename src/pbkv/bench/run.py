"""One simulated run: a workload, a policy, a concurrency, a profile -> one flat result record."""

from __future__ import annotations

from dataclasses import dataclass, field

from pbkv.cache import Capacities, RadixTree, Tier, TieredCache
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
    policy: str
    concurrency: int | None          # None: open loop by trace `t`
    profile: Profile
    device_tokens: int | None = None  # None: from the profile
    host_tokens: int | None = None
    disk_tokens: int | None = None
    options: dict = field(default_factory=dict)
    predictors: dict = field(default_factory=dict)   # variant -> trained predictor

    def capacities(self) -> Capacities:
        p = self.profile
        device = self.device_tokens or p.device_tokens
        host = self.host_tokens if self.host_tokens is not None else int(device * p.host_ratio)
        disk = self.disk_tokens if self.disk_tokens is not None else p.disk_tokens
        return Capacities(device, host, disk)


def nominal_duration(cost: CostModel, concurrency: int | None) -> callable:
    """Rough seconds per call for the oracle's schedule: decode at a typical batch, no cache."""
    batch = concurrency or 16

    def duration(call: Call) -> float:
        step = cost.decode_step_seconds(batch, batch * call.input_length)
        return call.output_length * step + cost.prefill_seconds(cost.prefill_flops(call.input_length, 0)) * 0.2
    return duration


def cost_hints(cost: CostModel) -> dict:
    """What a token costs to get back on the device, for policies that weigh it (Continuum)."""
    n = 4096
    return {"recompute_token_seconds": cost.prefill_seconds(cost.prefill_flops(n, n)) / n,
            "load_token_seconds": cost.load_seconds([0, n, 0]) / n}


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
    if predictors and not (cfg.options.get("online_learner") or cfg.options.get("live_predictions")):
        from pbkv.predict.cached import CachedPredictor  # same answers, batched ahead of the run
        predictors = {v: CachedPredictor(p, workload.workflows) for v, p in predictors.items()}
    ctx = PolicyContext(block_size=workload.trace.block_size, agent_graph=workload.agent_graph,
                        static_sequence=workload.static_sequence, options={**cost_hints(cost), **cfg.options},
                        predictors=predictors)
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
