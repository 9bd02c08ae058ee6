"""A benchmark sweep: every (workload, concurrency, policy) run, side by side, in parallel.

Records are returned in a fixed order (workload, concurrency, policy as given) and rounded, so
the same arguments and seed give byte-identical JSON whatever the worker count."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from typing import TYPE_CHECKING

from pbkv.bench import predictors as predictors_mod
from pbkv.bench import regimes as regimes_mod
from pbkv.bench import samples as samples_mod
from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile
from pbkv.policy.registry import needed_predictor
from pbkv.trace import read_trace

if TYPE_CHECKING:  # imported where used: they pull in the real engine / the vLLM runner
    from pbkv.bench.hf_run import HFConfig
    from pbkv.bench.vllm_run import VLLMConfig

# What a run's record keeps in bench.json, in this order (`finish_records`). Every figure a
# simulated run reports is here except `INTERNAL_KEYS` (tested: a new figure missing here would
# silently never reach the JSON).
RECORD_KEYS = ("workload", "policy", "concurrency", "pressure", "tiers", "engine", "samples", "workflows", "calls",
               "mean_workflow_latency_s", "p99_workflow_latency_s", "mean_ttft_s", "p99_ttft_s",
               "device_hit_rate", "host_hit_rate", "disk_hit_rate", "recomputed_tokens",
               "prompt_tokens", "bytes_loaded", "bytes_offloaded", "prefetched_tokens", "evictions",
               "device_tokens", "host_tokens", "disk_tokens", "makespan_s", "monitor_top1",
               "monitor_baseline_top1", "trust", "retired_reuse",
               # --online only: retrains swapped in, and those not used (trained on too few workflows)
               "online_retrains", "online_retrains_unused",
               # real engine (--engine hf) only
               "model", "scale", "wall_seconds", "idle_skipped_seconds", "computed_tokens", "prefill_seconds",
               "decode_seconds", "loaded_host_tokens", "loaded_disk_tokens", "load_waits",
               "recompute_instead_of_load", "failed_loads", "corrupt_files",
               "disk_write_errors", "failed_calls", "disk_files_written", "peak_rss_mb",
               # vLLM (--engine vllm) only
               "skipped_calls", "vllm_hit_tokens", "ram_hit_tokens", "disk_hit_tokens", "demoted_blocks",
               # several simulated instances behind a router (--instances / --router) only
               "instances", "router", "link", "bytes_moved_between_instances", "kv_fetches", "kv_fetch_failed",
               "workflow_moves", "max_instance_share", "shared_tier_tokens", "shared_tier_reads",
               "shared_tier_reads_failed", "bytes_from_shared_tier", "bytes_to_shared_tier", "vs_best_router_min", "vs_best_router_max")

INTERNAL_KEYS = ("decode_steps", "policy_overhead", "policy_seconds",   # the perf commands' figures
                 "shared_hit_rate")   # the real engine's shared directory: never in a bench run


@dataclass(frozen=True)
class Source:
    """Where a workload comes from: a generator spec (built-in name or file) or a trace file."""

    name: str
    spec: str | None = None
    trace: str | None = None
    workflows: int = 400
    seed: int = 0


@dataclass
class SweepConfig:
    """Every run of a sweep. `horizon`: the predicting policies' K (None: the predictor's);
    `online`: retrain the predictor from finished workflows during each run, starting from
    `train_files` (or, for a generated workload, its training set)."""

    sources: list[Source]
    policies: list[str]
    concurrency: list[int | None]
    profile: str = "a6000-qwen3-32b"
    cache: CacheConfig = field(default_factory=CacheConfig)
    jobs: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))
    horizon: int | None = None
    online: bool = False
    train_files: tuple[str, ...] = ()
    predictors: dict = field(default_factory=dict)   # (workload, variant) -> saved predictor dir
    pressures: list[float] | str | None = None       # device / distinct prompt tokens; "auto": per workload
    tiers: list[str] = field(default_factory=list)   # regimes.TIER_SETS; empty: from the profile / options
    engine: str = "sim"                              # sim | hf | vllm
    hf: HFConfig | None = None                       # the real engine's settings (engine "hf"; default HFConfig())
    vllm: VLLMConfig | None = None                   # vLLM's settings (engine "vllm"; default VLLMConfig())
    instances: int | list[int] = 1                   # simulated instances behind a router (sim only); a list: each
    routers: list[str] = field(default_factory=list)  # pbkv.route names; empty: one instance, no router
    link: str = "pcie4"                              # instance-to-instance KV link (pbkv.scale.links)
    shared_tokens: int = 0                           # a shared KV tier of this many tokens (0: none)
    shared_link: str = "nvme"                        # how instances read the shared tier
    samples: int = 1                                 # runs per cell at slightly larger memories, averaged
                                                     # (pbkv.bench.samples; simulator only)

    def instance_counts(self) -> list[int]:
        return [self.instances] if isinstance(self.instances, int) else list(self.instances)

    def router_runs(self) -> list[tuple[int, str | None]]:
        """(instances, router) of each run: (1, None) (one plain instance) unless instances > 1 or
        routers are set; else every instance count with every router."""
        counts = self.instance_counts()
        if max(counts) > 1 or self.routers:
            return [(n, r) for n in counts for r in (list(self.routers) or ["pbkv"])]
        return [(1, None)]


@functools.lru_cache(maxsize=8)
def load_workload(source: Source) -> Workload:
    """Generate or read a workload once per process."""
    if source.trace:
        trace = read_trace(source.trace)
        return Workload(source.name, trace)
    from pbkv.workloads import generate, load_spec
    from pbkv.workloads.spec_files import spec_source
    spec = load_spec(source.spec)
    trace = generate(spec, source.workflows, source.seed, spec_source(source.spec))  # errors name the file
    return Workload(source.name, trace, spec.edges())


def _run_one(args: tuple) -> dict:
    source, policy, concurrency, cfg, regime, (instances, router), sample = args
    if cfg.engine == "vllm":  # a child process of the vLLM venv; pbkv's predictor by directory
        from pbkv.bench.vllm_run import VLLMConfig, run_policy
        variant = needed_predictor(policy) if policy != "vllm" else None
        return run_policy(load_workload(source), policy, concurrency, (cfg.vllm or VLLMConfig()).with_cache(cfg.cache),
                          cfg.predictors.get((source.name, variant)) if variant else None)
    # only the variant this policy reads: loading (and batching answers for) a predictor that a
    # policy ignores cost about a third of the default run's CPU time
    wanted = needed_predictor(policy)
    predictors = {variant: predictors_mod.load(path)
                  for (name, variant), path in cfg.predictors.items() if name == source.name and variant == wanted}
    learner = None
    if cfg.online and predictors:
        learner = predictors_mod.online_learner(source, list(cfg.train_files), predictors[wanted])
    cache = replace(cfg.cache, device_tokens=regime.device_tokens, host_tokens=regime.host_tokens,
                    disk_tokens=regime.disk_tokens)
    run = RunConfig(policy=policy, concurrency=concurrency, profile=load_profile(cfg.profile), cache=cache,
                    predictors=predictors, horizon=cfg.horizon, online_learner=learner)
    run = samples_mod.scaled(run, sample)
    if cfg.engine == "hf":
        from pbkv.bench.hf_run import HFConfig, run_hf
        record = run_hf(load_workload(source), run, cfg.hf or HFConfig())
    elif router is not None:
        from pbkv.bench.cluster_run import simulate_cluster
        from pbkv.scale.links import get_link
        record = simulate_cluster(load_workload(source), run, instances, router, get_link(cfg.link),
                                  shared_tokens=samples_mod.tokens(cfg.shared_tokens, sample),
                                  shared_link=get_link(cfg.shared_link))
    else:
        record = simulate(load_workload(source), run)
    record.update(workload=source.name, policy=policy, concurrency=concurrency, engine=cfg.engine,
                  pressure=regime.pressure, tiers=regime.tiers)
    if cfg.samples > 1:
        record[samples_mod.SAMPLE_KEY] = sample
    if learner is not None:   # --online only: a run without it keeps its record as it was
        record.update(online_retrains=learner.used, online_retrains_unused=learner.dropped)
    return record


def sweep_regimes(cfg: SweepConfig, source: Source, concurrency: int | None) -> list[regimes_mod.Regime]:
    """The memory regimes one (workload, concurrency) cell runs in (vLLM: its own sizes only)."""
    if cfg.engine == "vllm":
        return [regimes_mod.Regime()]
    if cfg.engine == "hf" and cfg.pressures == "auto":  # the real engine sizes its (scaled) memory itself
        return regimes_mod.regimes(None, [], cfg.tiers, cfg.cache.device_tokens, cfg.cache.host_tokens, cfg.cache.disk_tokens)
    if cfg.engine == "hf" and cfg.pressures:
        raise ValueError("--pressure sizes the simulator's memory; with --engine hf give --device-tokens")
    workload = load_workload(source)
    if cfg.pressures == "auto" and cfg.cache.device_tokens is None:
        return regimes_mod.auto_regimes(workload, concurrency, cfg.tiers, cfg.cache.host_tokens, cfg.cache.disk_tokens)
    pressures = ([] if cfg.pressures == "auto" else cfg.pressures) or []
    return regimes_mod.regimes(workload, pressures, cfg.tiers, tier_device(cfg, pressures), cfg.cache.host_tokens,
                               cfg.cache.disk_tokens)


def pressure_notes(cfg: SweepConfig) -> list[str]:
    """One line per workload whose requested --pressure fractions are clamped up to its largest
    call (the simulator sizes the device from them only when no --device-tokens is given)."""
    if cfg.engine != "sim" or not isinstance(cfg.pressures, list) or cfg.cache.device_tokens is not None:
        return []
    notes = (regimes_mod.clamp_note(load_workload(s), cfg.pressures) for s in cfg.sources)
    return [n for n in notes if n]


def tier_device(cfg: SweepConfig, pressures: list[float]) -> int | None:
    """The device size a regime's tier ratios apply to: the given one, else (simulator, tier sets
    given, no pressures: `--pressure profile`) the profile's device, so --tiers device+host+disk
    gets its 2x host and 8x disk rather than the profile's own tiers (whose disk is often 0)."""
    device = cfg.cache.device_tokens
    if device is None and cfg.tiers and not pressures and cfg.engine == "sim":
        return load_profile(cfg.profile).device_tokens
    return device


def sweep_jobs(cfg: SweepConfig) -> list[tuple]:
    """Every run, in record order: workload, concurrency, regime, router (several instances
    only), policy, sample (`--samples`)."""
    return [(s, p, c, cfg, rg, r, i) for s in cfg.sources for c in cfg.concurrency
            for rg in sweep_regimes(cfg, s, c) for r in cfg.router_runs() for p in cfg.policies
            for i in range(cfg.samples)]


def run_sweep(cfg: SweepConfig, on_done=None, jobs: list[tuple] | None = None) -> list[dict]:
    """Run every configuration (`jobs`: `sweep_jobs(cfg)`, when the caller has them already);
    `on_done(record)` is called as each finishes (any order). At most min(cfg.jobs, cells) worker
    processes are started."""
    jobs = sweep_jobs(cfg) if jobs is None else jobs
    results: list[dict | None] = [None] * len(jobs)
    # real-engine runs go one after another in this process: one model load, and wall times
    # not distorted by a second run competing for the cores
    if cfg.jobs <= 1 or len(jobs) == 1 or cfg.engine in ("hf", "vllm"):
        for i, job in enumerate(jobs):
            results[i] = _run_one(job)
            if on_done:
                on_done(results[i])
    else:
        with ProcessPoolExecutor(max_workers=min(cfg.jobs, len(jobs))) as pool:  # a worker per cell at most
            futures = {pool.submit(_run_one, job): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if on_done:
                    on_done(results[futures[fut]])
    if cfg.samples > 1:
        results = samples_mod.average(results, cell_of)
    return finish_records(results)


def finish_records(records: list[dict]) -> list[dict]:
    """Order keys, add `speedup_vs_lru` (and hit-rate ratio) to non-LRU records (against LRU in
    the same workload, concurrency and regime), round floats.
    On vLLM (`engine` "vllm") the baseline is vLLM alone (policy "vllm") instead of LRU."""
    def baseline(r):
        return "vllm" if r.get("engine") == "vllm" else "lru"
    lru = {cell_of(r): r for r in records if r["policy"] == baseline(r)}
    out = []
    for r in records:
        rec = {k: r[k] for k in RECORD_KEYS if k in r}
        base = lru.get(cell_of(r))
        if base is not None and r["policy"] != baseline(r):
            rec["speedup_vs_lru"] = base["mean_workflow_latency_s"] / max(r["mean_workflow_latency_s"], 1e-12)
            if base["mean_ttft_s"] is not None and r["mean_ttft_s"] is not None:   # vLLM: None unmeasured
                rec["ttft_speedup_vs_lru"] = base["mean_ttft_s"] / max(r["mean_ttft_s"], 1e-12)
            rec["device_hit_ratio_vs_lru"] = r["device_hit_rate"] / max(base["device_hit_rate"], 1e-12)
            for k in ("speedup_vs_lru_min", "speedup_vs_lru_max"):   # --samples: the per-sample range
                if k in r:
                    rec[k] = r[k]
        out.append({k: _round(v) for k, v in rec.items()})
    return out


def cell_of(r: dict) -> tuple:
    """The runs a policy is compared within: same workload, concurrency, regime, and instances
    and router (if any). The router comes last: `samples` drops it to pair routers."""
    return r["workload"], r["concurrency"], r.get("pressure"), r.get("tiers"), r.get("instances"), r.get("router")


def _round(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def is_spec_file(value: str) -> bool:
    """Whether `value` names a spec file rather than a built-in workload: its suffix is one of
    `spec_files.SUFFIXES` in any case, as the spec loader reads it (`MY.YAML` is a spec file)."""
    from pbkv.workloads.spec_files import SUFFIXES
    return Path(value).suffix.lower() in SUFFIXES


def source_from_arg(value: str, workflows: int, seed: int) -> Source:
    """A built-in workload name, a spec file (.yaml/.yml/.json) or a trace (.jsonl/.jsonl.gz)."""
    path = Path(value)
    if value.endswith((".jsonl", ".jsonl.gz")):
        return trace_source(value)
    name = path.stem if is_spec_file(value) else value
    return Source(name=name, spec=value, workflows=workflows, seed=seed)


def trace_source(value: str) -> Source:
    """A trace file, whatever its name (`--trace`); named by its file name without `.gz` and
    `.jsonl` (`a/x.v1.jsonl.gz`: `x.v1`)."""
    name = Path(value).name.removesuffix(".gz").removesuffix(".jsonl") or Path(value).name
    return Source(name=name, trace=value)


def check_names(sources: list[Source]) -> None:
    """Raise ValueError when two sources share a name: records, tables and plots are keyed by it,
    so their figures would be mixed up and one plot would overwrite the other."""
    where: dict[str, str] = {}
    for s in sources:
        arg = s.trace or s.spec or s.name
        other = where.get(s.name)
        where[s.name] = arg
        if other is not None:
            if other == arg:
                raise ValueError(f"{arg} given twice; give each workload once")
            raise ValueError(f"{other} and {arg} are both named {s.name!r}: their rows and plots would be "
                             f"mixed up; rename one of the files")
