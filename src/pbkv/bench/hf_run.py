"""One run on the real engine (`pbkv bench --engine hf`): a workload, a policy, a concurrency.

The same driver (`pbkv.driver.Replay`, closed-loop lanes or open-loop arrivals) drives the real
engine exactly as it drives the simulator; the engine's wall clock (idle tool waits skipped, see
`pbkv.engine.hf.transfer.WallClock`) replaces simulated time. The workload is first scaled
(`--scale F`: every length / F, prefix sharing kept) so a real trace fits a CPU; block ids
become token ids by the trace format's rule. Capacities are in (scaled) tokens; without
`--device-tokens` the device holds 8 times the longest call, host = profile `host_ratio` x
device, disk = 8 x device unless given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pbkv.bench.run import RunConfig, Workload, check_fits
from pbkv.cache import Capacities, CapacityDefaults, RadixTree, Tier, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.policy import PolicyContext, make_policy, needs_future
from pbkv.policy.future import Future


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


def run_hf(workload: Workload, cfg: RunConfig, hf: HFConfig, progress=None) -> dict:
    """Replay `workload` on the real model under `cfg`; the simulator's record plus real figures."""
    from pbkv.engine.hf import EngineOptions, HFEngine, scale_trace

    scaled = Workload(workload.name, scale_trace(workload.trace, hf.scale, hf.output_scale), workload.agent_graph)
    caps = hf_capacities(scaled, cfg)
    check_fits(scaled, caps.device)
    lm = get_model(hf)
    predictors = cfg.predictors
    if predictors and not cfg.online_learner:
        from pbkv.predict.cached import CachedPredictor
        predictors = {v: CachedPredictor(p, scaled.workflows) for v, p in predictors.items()}
    ctx = PolicyContext(block_size=scaled.trace.block_size, agent_graph=scaled.agent_graph,
                        static_sequence=scaled.static_sequence, horizon=cfg.horizon,
                        online_learner=cfg.online_learner, predictors=predictors)
    if needs_future(cfg.policy):
        # the oracle's rough per-call cost: CPU-scale prefill and decode speeds
        ctx.future = Future(scaled.workflows, scaled.trace.block_size, cfg.concurrency,
                            lambda c: c.input_length / 5000 + c.output_length * 0.005)
    policy = make_policy(cfg.policy, ctx)
    cache = TieredCache(RadixTree(scaled.trace.block_size), caps, policy)
    engine = HFEngine(lm, cache, policy, options=EngineOptions(load_rule=hf.load_rule, seed=hf.seed),
                      disk_dir=hf.disk_dir)
    start = time.perf_counter()
    try:
        recorder = Replay(engine, scaled.workflows, cfg.concurrency, Recorder(), progress).run()
    finally:
        engine.close()
    wall = time.perf_counter() - start
    record = recorder.summary()
    s, kv = engine.stats, lm.kv_bytes_per_token
    record.update({
        "engine": "hf", "model": lm.name, "scale": hf.scale,
        "wall_seconds": wall, "idle_skipped_seconds": engine.clock.skipped,
        "computed_tokens": s.computed_tokens, "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds, "decode_steps": s.decode_steps,
        "loaded_host_tokens": s.loaded_tokens[Tier.HOST], "loaded_disk_tokens": s.loaded_tokens[Tier.DISK],
        "bytes_loaded": kv * (s.loaded_tokens[Tier.HOST] + s.loaded_tokens[Tier.DISK]),
        "bytes_offloaded": kv * cache.stats.demoted[Tier.DEVICE],
        "prefetched_tokens": s.prefetched_tokens, "evictions": cache.stats.evictions,
        "load_waits": s.load_waits, "recompute_instead_of_load": s.recompute_instead_of_load,
        "failed_loads": s.failed_loads, "corrupt_files": engine.store.stats.corrupt,
        "disk_files_written": engine.store.stats.files_written,
        "device_tokens": caps.device, "host_tokens": caps.host, "disk_tokens": caps.disk,
        "policy_seconds": s.policy_seconds, "peak_rss_mb": peak_rss_mb(),
    })
    monitor = getattr(policy, "monitor", None)
    if monitor is not None:
        record.update(monitor.summary())
    return record


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB): model, KV tiers and everything else.
    The bench runs each policy in its own worker process when `--jobs` > 1; with one job the
    figure is the peak over the runs so far."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)  # bytes on macOS, KiB on Linux
