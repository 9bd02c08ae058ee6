"""One run on the real engine (`pbkv bench --engine hf`): a workload, a policy, a concurrency.

The run is built by the same function as a simulated one (`pbkv.bench.runner.run_workload`: the
same predictors, policy, cache and driver, closed-loop lanes or open-loop arrivals); only the
engine differs (`HFSetup`); the engine's wall clock (idle tool waits skipped, see
`pbkv.engine.hf.transfer.WallClock`) replaces simulated time. The workload is first scaled
(`--scale F`: every length / F, prefix sharing kept) so a real trace fits a CPU; block ids
become token ids by the trace format's rule. Capacities are in (scaled) tokens; without
`--device-tokens` the device holds 8 times the longest call, host = profile `host_ratio` x
device, disk = 8 x device unless given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pbkv.bench.run import RunConfig, Workload
from pbkv.bench.runner import EngineSetup, run_workload
from pbkv.cache import Capacities, CapacityDefaults, Tier, TieredCache
from pbkv.policy import Policy
from pbkv.trace import Call


@dataclass(frozen=True)
class HFConfig:
    model: str = "tiny"             # tiny | smollm2 | a local model directory
    scale: float = 1.0
    output_scale: float | None = None  # outputs divided by this instead (None: `scale`)
    load_rule: str = "auto"
    threads: int | None = 1         # torch CPU threads (None: leave torch's setting)
    seed: int = 0
    disk_dir: str | None = None     # default: a temporary directory per run


_models: dict = {}


def get_model(hf: HFConfig):
    """Load a model once per process."""
    import torch

    from pbkv.engine.hf import load_model
    if hf.threads:
        torch.set_num_threads(hf.threads)
    key = (hf.model, hf.seed)
    if key not in _models:
        _models[key] = load_model(hf.model, seed=hf.seed)
    return _models[key]


def hf_capacities(workload: Workload, cfg: RunConfig) -> Capacities:
    """The real engine's capacities: unset ones 8 x the longest call, host_ratio x, 8 x device."""
    longest = max(c.input_length + c.output_length for c in workload.trace.calls)
    return cfg.cache.resolve(CapacityDefaults(8 * longest, host_ratio=cfg.profile.host_ratio, disk_ratio=8))


@dataclass
class HFSetup(EngineSetup):
    """The real engine on a loaded model: capacities from `hf_capacities`, wall-clock time."""

    lm: object                      # pbkv.engine.hf.LoadedModel
    hf: HFConfig
    reports_failed_calls = True     # a call whose forward pass raised ends with "error"

    def __post_init__(self):
        self.kv_bytes_per_token = self.lm.kv_bytes_per_token

    def capacities(self, workload: Workload, cfg: RunConfig) -> Capacities:
        return hf_capacities(workload, cfg)

    def call_seconds(self, call: Call) -> float:
        return call.input_length / 5000 + call.output_length * 0.005  # CPU-scale prefill and decode speeds

    def make_engine(self, cache: TieredCache, policy: Policy):
        from pbkv.engine.hf import EngineOptions, HFEngine
        return HFEngine(self.lm, cache, policy, options=EngineOptions(load_rule=self.hf.load_rule, seed=self.hf.seed),
                        disk_dir=self.hf.disk_dir)

    def close(self, engine) -> None:
        engine.close()

    def record(self, engine, cache: TieredCache, wall_seconds: float) -> dict:
        s, kv = engine.stats, self.kv_bytes_per_token
        return {
            "engine": "hf", "model": self.lm.name, "scale": self.hf.scale,
            "wall_seconds": wall_seconds, "idle_skipped_seconds": engine.clock.skipped,
            "computed_tokens": s.computed_tokens,
            "loaded_host_tokens": s.loaded_tokens[Tier.HOST], "loaded_disk_tokens": s.loaded_tokens[Tier.DISK],
            "bytes_loaded": kv * (s.loaded_tokens[Tier.HOST] + s.loaded_tokens[Tier.DISK]),
            "load_waits": s.load_waits, "recompute_instead_of_load": s.recompute_instead_of_load,
            "failed_loads": s.failed_loads, "corrupt_files": engine.store.stats.corrupt,
            "disk_write_errors": engine.store.stats.write_errors,
            "disk_files_written": engine.store.stats.files_written, "peak_rss_mb": peak_rss_mb(),
        }


def run_hf(workload: Workload, cfg: RunConfig, hf: HFConfig, progress=None, allow_failed: bool = False) -> dict:
    """Replay `workload`, scaled by `hf`, on the real model under `cfg`; the record of
    `runner.run_workload` plus the real engine's figures. Raises EngineError when calls failed
    inside the engine (`check_failed_calls`), unless `allow_failed`."""
    record = run_workload(scale_workload(workload, hf), cfg, HFSetup(get_model(hf), hf), progress)
    if not allow_failed:
        check_failed_calls(record, f"{workload.name} {cfg.policy} c={cfg.concurrency}")
    return record


def check_failed_calls(record: dict, setup: str) -> None:
    """Raise EngineError (`pbkv bench`: one `error:` line, exit 2) when calls of this run failed
    inside the engine (`failed_calls`): its figures leave them out (no first token), so they
    would describe a run that did not happen as asked."""
    from pbkv.engine.hf import EngineError
    failed = record.get("failed_calls", 0)
    if failed:
        raise EngineError(f"{setup}: {failed} of {record['calls']} calls failed in the engine "
                          f"(first: {record.get('first_error')}); no figures written")


def scale_workload(workload: Workload, hf: HFConfig) -> Workload:
    """`workload` with every length divided by `hf.scale` (outputs by `hf.output_scale`)."""
    from pbkv.engine.hf import scale_trace
    return Workload(workload.name, scale_trace(workload.trace, hf.scale, hf.output_scale), workload.agent_graph)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB): model, KV tiers and everything else.
    The bench runs each policy in its own worker process when `--jobs` > 1; with one job the
    figure is the peak over the runs so far."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)  # bytes on macOS, KiB on Linux
