"""`pbkv bench` and `pbkv ablate`: policies side by side (pbkv.bench.main does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pbkv.cli.common import (ConcurrencyOpt, DeviceTokensOpt, DiskTokensOpt, HorizonOpt, HostTokensOpt, JobsOpt,
                             JsonOpt, LoadRuleOpt, ModelOpt, OnlineOpt, OutOpt, OutputScaleOpt, PoliciesOpt,
                             PredictorOpt, ProfileOpt, RouterOpt, ScaleOpt, SeedOpt, ThreadsOpt, TracesOpt, TrainOpt,
                             WorkflowsOpt, WorkloadOpt, DebugOpt, check_exist, check_horizon, check_outputs, check_outside, concurrency_list,
                             console, distinct, exit_on_error, fail, split, strs)

ENGINES = ("sim", "hf", "vllm")
MAX_INSTANCES = 1024
EngineOpt = Annotated[str, typer.Option(
    help="Engine: 'sim' (the discrete-event simulator), 'hf' (a real transformers model, wall-clock time) or "
         "'vllm' (a real vLLM alone (policy 'vllm') and with pbkv's connector per policy; docs/vllm.md).")]
PressureOpt = Annotated[str, typer.Option(
    help="Device capacity as a fraction of the replay's distinct prompt tokens, comma-separated (e.g. "
         "0.02,0.05,0.1); 'auto': chosen from each workload's working set (the default run's regimes); "
         "'profile': the profile's device (and, with --tiers auto, the profile's host and disk). "
         "A fraction below the largest call is raised to it (a note says so). --device-tokens wins. "
         "--engine hf: 'auto' only (its own sizes, or --device-tokens).")]
TiersOpt = Annotated[str, typer.Option(
    help="Tier sets to run, comma-separated: device (vLLM-like), device+host (host 2x device, HiCache-like), "
         "device+host+disk (plus disk 8x device); each runs exactly its tiers, whatever the profile's (--host-tokens "
         "/ --disk-tokens win over the ratios; a size for a tier no set has, or 0 for one it has, is an error); "
         "'auto': the default run's pairs with --pressure auto, else the profile's tiers.")]
VLLMPythonOpt = Annotated[Optional[Path], typer.Option(
    help="--engine vllm: python of the venv with vLLM (default: .venv-vllm/bin/python; see docs/vllm.md).")]
InstancesOpt = Annotated[str, typer.Option(
    help="Simulated engine instances, each with its own cache and policy, behind --router (--engine sim; "
         "docs/scale-out.md); comma-separated counts run each (2,4,8). 1 with no --router: one plain instance.")]
LinkOpt = Annotated[str, typer.Option(
    help="Instance-to-instance KV link: nvlink-h100, nvlink-a6000, pcie4, rdma, tcp (pbkv.scale.links).")]
SharedTokensOpt = Annotated[int, typer.Option(
    min=0, help="With --instances: a KV tier of this many tokens every instance writes and reads (0: none).")]
SamplesOpt = Annotated[int, typer.Option(
    help="Run each cell this many times, every tier 0.5% larger each time, and report the means and the range "
         "of speedups (--engine sim; a replay's latency moves ~1% with a few tokens of memory: "
         "pbkv.bench.samples).")]
# bench and ablate: --workload and --workflows when not given (their declared default is None)
BENCH_WORKLOADS, ABLATE_WORKLOADS, WORKFLOWS = "hover,swe,finance,dialogue", "hover,swe,finance", 400


SharedLinkOpt = Annotated[str, typer.Option(help="How instances read the shared tier (a --link name; default nvme).")]


def bench(
    workload: WorkloadOpt = None,   # None: not given (told apart from the default when --trace is given)
    trace: TracesOpt = None,
    policies: PoliciesOpt = "lru,kvflow,continuum,scalesim,arc,slru,pbkv,oracle",
    concurrency: ConcurrencyOpt = "64",
    pressure: PressureOpt = "auto",
    tiers: TiersOpt = "auto",
    profile: ProfileOpt = "a6000-qwen3-32b",
    device_tokens: DeviceTokensOpt = None,
    host_tokens: HostTokensOpt = None,
    disk_tokens: DiskTokensOpt = None,
    workflows: WorkflowsOpt = None,
    seed: SeedOpt = 0,
    train: TrainOpt = None,
    predictor: PredictorOpt = None,
    horizon: HorizonOpt = None,
    online: OnlineOpt = False,
    engine: EngineOpt = "sim",
    model: ModelOpt = "tiny",
    scale: ScaleOpt = 1.0,
    output_scale: OutputScaleOpt = None,
    load_rule: LoadRuleOpt = "auto",
    threads: ThreadsOpt = 1,
    vllm_python: VLLMPythonOpt = None,
    instances: InstancesOpt = "1",
    router: RouterOpt = None,
    link: LinkOpt = "pcie4",
    shared_tokens: SharedTokensOpt = 0,
    shared_link: SharedLinkOpt = "nvme",
    samples: SamplesOpt = 1,
    jobs: JobsOpt = 2,
    out: OutOpt = Path("results/bench"),
    json_path: JsonOpt = None,
    debug: DebugOpt = False,
    ctx: typer.Context = None,   # where --model came from (--engine vllm: "tiny" given by name)
):
    """Compare cache policies side by side on workloads or traces; print a table, save JSON and plots."""
    from pbkv.bench.main import BenchArgs
    from pbkv.bench.predictors import PredictorSource
    from pbkv.cache import CacheConfig

    hf = vllm = None
    if engine in ("hf", "vllm"):
        hf = hf_config(model, scale, output_scale, load_rule, threads, seed)  # vllm: the same checks
    if engine == "vllm":
        given = getattr(ctx.get_parameter_source("model"), "name", None) if ctx is not None else None
        if model == "tiny" and given == "COMMANDLINE":
            # the default "tiny" stands for SmolLM2 here; asked for by name it ran SmolLM2 silently
            fail("--model tiny: the random small Llama of --engine hf has no Hugging Face folder vLLM can load; "
                 "--engine vllm runs SmolLM2 (--model smollm2, the default) or --model DIR")
        for option, value, default in (("--load-rule", load_rule, "auto"), ("--threads", threads, 1)):
            if value != default:   # the real transformers engine's settings: vLLM would ignore them
                fail(f"{option}: a setting of --engine hf; --engine vllm schedules its own loads and threads")
        vllm = vllm_config(vllm_python, model, scale, output_scale, seed)
    if engine not in ENGINES:
        fail(f"--engine: unknown engine {engine!r}; available: {', '.join(ENGINES)}")
    check_horizon(horizon)
    check_exist(*(trace or []), *(train or []), predictor)
    if json_path is not None and json_path.resolve() == (out / "bench.json").resolve():
        json_path = None   # the same file: written once
    check_outputs([*(trace or []), *(train or [])], {"--out": out / "bench.json", **({"--json": json_path} if json_path else {})})
    check_outside({"--predictor": predictor}, {"--out": out, "--json": json_path})
    run_bench(BenchArgs(
        sources=sources(workload, BENCH_WORKLOADS, trace, workflows, seed), policies=distinct("--policies", split(policies)),
        concurrency=concurrency_list(concurrency), profile=profile,
        cache=CacheConfig(device_tokens, host_tokens, disk_tokens), jobs=jobs, out=out, json_path=json_path,
        horizon=horizon, online=online, train_files=strs(train), engine=engine, hf=hf, vllm=vllm,
        instances=instance_list(instances), routers=distinct("--router", split(router)) if router else [], link=link, shared_tokens=shared_tokens,
        shared_link=shared_link, samples=samples,
        predictor=PredictorSource(predictor=str(predictor) if predictor else None, train=strs(train),
                                  horizon=horizon or 3), **regime_args(pressure, tiers, engine)), debug)


def instance_list(value: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8] (exit 2 on anything but positive integers)."""
    out = [int(v) for v in split(value) if v.isdigit() and int(v) > 0]
    if not out or len(out) != len(split(value)):
        fail(f"--instances: expected positive integers, comma-separated, got {value!r}")
    if max(out) > MAX_INSTANCES:  # each is a simulator with its own cache; a router weighs all per call
        fail(f"--instances: at most {MAX_INSTANCES} instances, got {max(out)}")
    return distinct("--instances", out)


def regime_args(pressure: str, tiers: str, engine: str = "sim") -> dict:
    """--pressure and --tiers, validated (clear error, exit 2). On the real engine only 'auto' (its
    own sizes: 8 x the longest scaled call, or --device-tokens): a fraction or 'profile' sizes the
    simulator's memory (a profile's device is a GPU's tokens for its model, not the scaled run's)."""
    from pbkv.bench.regimes import parse_pressures, parse_tiers
    if engine == "hf" and pressure != "auto":
        fail(f"--pressure {pressure}: sizes the simulator's memory; with --engine hf give --device-tokens")
    with exit_on_error():
        press = pressure if pressure == "auto" else None if pressure == "profile" else parse_pressures(pressure)
        return {"pressures": press, "tiers": [] if tiers == "auto" else parse_tiers(tiers)}


def ablate(
    workload: WorkloadOpt = None,
    trace: TracesOpt = None,
    concurrency: ConcurrencyOpt = "64,96,128",
    pressure: PressureOpt = "auto",   # as bench: the profile's whole memory evicts nothing to ablate
    tiers: TiersOpt = "auto",
    profile: ProfileOpt = "a6000-qwen3-32b",
    device_tokens: DeviceTokensOpt = None,
    host_tokens: HostTokensOpt = None,
    disk_tokens: DiskTokensOpt = None,
    workflows: WorkflowsOpt = None,
    seed: SeedOpt = 0,
    train: TrainOpt = None,
    horizon: HorizonOpt = None,
    samples: SamplesOpt = 1,
    jobs: JobsOpt = 2,
    out: OutOpt = Path("results/ablate"),
    debug: DebugOpt = False,
):
    """The ablation table in one command: lru, kvflow, pbkv-retired, pbkv-noprefetch, pbkv-history,
    pbkv-context, pbkv, oracle, side by side, in the same memory regimes as `pbkv bench`."""
    from pbkv.bench.main import ABLATION, BenchArgs
    from pbkv.bench.predictors import PredictorSource
    from pbkv.cache import CacheConfig

    check_horizon(horizon)
    check_exist(*(trace or []), *(train or []))
    check_outputs([*(trace or []), *(train or [])], {"--out": out / "bench.json"})
    run_bench(BenchArgs(
        sources=sources(workload, ABLATE_WORKLOADS, trace, workflows, seed), policies=ABLATION,
        concurrency=concurrency_list(concurrency), profile=profile,
        cache=CacheConfig(device_tokens, host_tokens, disk_tokens), jobs=jobs, out=out, horizon=horizon,
        samples=samples, predictor=PredictorSource(train=strs(train), horizon=horizon or 3, takes_predictor=False),
        **regime_args(pressure, tiers)), debug)


def sources(workload: str | None, default: str, trace: list[Path] | None, workflows: int | None,
            seed: int) -> list:
    """The replayed traces, or else the generated workloads (`default` when --workload is not
    given). Exit 2 when --workload or --workflows is given with --trace (it would be ignored) or
    --workload names no workload. Invariant: the list is never empty."""
    from pbkv.bench.sweep import source_from_arg, trace_source
    if trace:
        for option, value in (("--workload", workload), ("--workflows", workflows)):
            if value is not None:
                fail(f"{option}: not with --trace (the traces are replayed whole, nothing is generated)")
        return [trace_source(str(t)) for t in trace]   # a trace whatever its name ends in
    names = split(default if workload is None else workload)
    if not names:
        fail(f"--workload: give at least one workload (hover, swe, ...) or --trace FILE, got {workload!r}")
    return [source_from_arg(w, workflows or WORKFLOWS, seed) for w in names]


def run_bench(args, debug: bool = False) -> None:
    """Run the sweep; a failure is one `error:` line (exit 1) unless `debug`."""
    from pbkv.bench.main import run
    with exit_on_error(debug):
        run(args, console)


def hf_config(model: str, scale: float, output_scale: float | None, load_rule: str, threads: int, seed: int):
    """The real engine's settings from the command line, validated (clear error, exit 2)."""
    from pbkv.bench.hf_run import HFConfig
    from pbkv.engine.hf.engine import LOAD_RULES
    from pbkv.engine.hf.model import check_model_arg
    with exit_on_error():
        check_model_arg(model)  # before training predictors or calibrating, not minutes into the run
    if not 1 <= scale < float("inf"):  # also refuses nan
        fail(f"--scale: must be a finite number >= 1, got {scale}")
    if output_scale is not None and not 1 <= output_scale < float("inf"):
        fail(f"--output-scale: must be a finite number >= 1, got {output_scale}")
    if load_rule not in LOAD_RULES:
        fail(f"--load-rule: expected one of {', '.join(LOAD_RULES)}, got {load_rule!r}")
    return HFConfig(model=model, scale=scale, output_scale=output_scale, load_rule=load_rule, threads=threads,
                    seed=seed)


def vllm_config(python: Path | None, model: str, scale: float, output_scale: float | None, seed: int):
    """--engine vllm: the vLLM venv's python (clear error, exit 2); its capacities come from the
    sweep's CacheConfig (`VLLMConfig.with_cache`)."""
    from pbkv.bench.vllm_run import VLLMConfig, find_python
    with exit_on_error():
        return VLLMConfig(python=find_python(str(python) if python else None), scale=scale,
                          output_scale=output_scale, seed=seed,
                          model=None if model in ("tiny", "smollm2") else model)
