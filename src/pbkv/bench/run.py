"""A run's inputs (`Workload`, `RunConfig`) and the simulated run: a workload, a policy, a
concurrency, a profile -> one flat result record. The run itself is built by
`pbkv.bench.runner.run_workload`; the simulator only brings its `SimSetup`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pbkv.bench.runner import EngineSetup, run_workload
from pbkv.cache import CacheConfig, Capacities, CapacityDefaults, Tier, TieredCache
from pbkv.engine.cost import CostModel
from pbkv.engine.profiles import Profile
from pbkv.engine.simulator import Simulator
from pbkv.policy import Policy
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


@dataclass
class SimSetup(EngineSetup):
    """The simulator: capacities from the profile (or the run's), time from its cost model."""

    cost: CostModel
    concurrency: int | None

    def __post_init__(self):
        self.kv_bytes_per_token = self.cost.kv_bytes
        self._duration = nominal_duration(self.cost, self.concurrency)

    def call_seconds(self, call: Call) -> float:
        return self._duration(call)

    def token_costs(self) -> tuple[float, float]:
        """Seconds to recompute one token (a 4,096-token prompt over a 4,096-token prefix) and
        to load one back from host, from the cost model (Continuum weighs them)."""
        n, cost = 4096, self.cost
        return cost.prefill_seconds(cost.prefill_flops(n, n)) / n, cost.load_seconds([0, n, 0]) / n

    def capacities(self, workload: Workload, cfg: RunConfig) -> Capacities:
        return cfg.capacities()

    def make_engine(self, cache: TieredCache, policy: Policy) -> Simulator:
        return Simulator(self.cost, cache, policy)

    def record(self, engine: Simulator, cache: TieredCache, wall_seconds: float) -> dict:
        loaded = cache.stats.loaded
        return {"bytes_loaded": self.kv_bytes_per_token * (loaded[Tier.HOST] + loaded[Tier.DISK])}


def simulate(workload: Workload, cfg: RunConfig, progress=None) -> dict:
    """Replay `workload` under `cfg` on the simulator; the record of `runner.run_workload`."""
    return run_workload(workload, cfg, SimSetup(CostModel(cfg.profile), cfg.concurrency), progress)
