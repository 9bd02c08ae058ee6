"""`pbkv calibrate` and `pbkv simcheck`: measure the real engine, and hold the simulator against it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from pbkv.cli.bench import hf_config
from pbkv.cli.common import (ConcurrencyOpt, DeviceTokensOpt, DiskTokensOpt, HostTokensOpt, LoadRuleOpt, ModelOpt,
                             OutOpt, OutputScaleOpt, PoliciesOpt, ProfileOpt, ScaleOpt, SeedOpt, ThreadsOpt,
                             TrainOpt, WorkflowsOpt, WorkloadOpt, console, distinct, exit_on_error, fail,
                             one_concurrency, output_opt, save_json, split, strs)


def calibrate(
    output: output_opt("the profile (a .json file, as --profile FILE reads it)"),
    model: ModelOpt = "tiny",
    max_len: Annotated[int, typer.Option(min=32, help="Longest prompt measured, in tokens.")] = 512,
    repeats: Annotated[int, typer.Option(min=1, help="Runs per measurement (the best counts).")] = 2,
    threads: ThreadsOpt = 1,
):
    """Measure the real engine here (prefill vs prompt and cached prefix, decode step vs context, host copy
    and disk read bandwidth) and write a simulator profile (for --profile FILE)."""
    from pbkv.bench.hf_run import HFConfig
    from pbkv.bench.simcheck import calibrate as run_calibrate

    with exit_on_error():
        prof = run_calibrate(HFConfig(model=model, threads=threads), output, max_len, repeats)
    for line in prof["sources"][:-1]:
        console.print(line)
    console.print(f"profile: {output}", markup=False)  # a path is text, not rich markup


SIMCHECK_WORKFLOWS = 8   # --workflows when not given


def simcheck(
    model: ModelOpt = "tiny",
    profile: ProfileOpt = None,
    workload: WorkloadOpt = "hover",
    workflows: WorkflowsOpt = None,   # None: not given (SIMCHECK_WORKFLOWS; refused with a trace)
    concurrency: ConcurrencyOpt = "4",
    policies: PoliciesOpt = "lru,kvflow,pbkv,oracle",
    scale: ScaleOpt = 8.0,
    output_scale: OutputScaleOpt = None,
    device_tokens: DeviceTokensOpt = None,
    host_tokens: HostTokensOpt = None,
    disk_tokens: DiskTokensOpt = None,
    load_rule: LoadRuleOpt = "auto",
    train: TrainOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    out: OutOpt = Path("results/simcheck"),
):
    """Replay one small workload on the real engine and on the simulator (calibrated profile), per policy,
    and print both side by side."""
    from pbkv.bench.predictors import PredictorSource
    from pbkv.bench.report import print_whole
    from pbkv.bench.simcheck import calibrate as run_calibrate
    from pbkv.bench.simcheck import simcheck as run_simcheck
    from pbkv.bench.simcheck import check_load_rule, table, verdict
    from pbkv.bench.sweep import load_workload, source_from_arg
    from pbkv.cache import CacheConfig, Capacities, CapacityDefaults
    from pbkv.engine.profiles import load_profile

    hf = hf_config(model, scale, output_scale, load_rule, threads, seed)
    lanes = one_concurrency(concurrency)
    names = policy_list(policies)
    with exit_on_error():
        source = source_from_arg(workload, workflows or SIMCHECK_WORKFLOWS, seed)
        replayed = len(load_workload(source).workflows)  # a bad --workload fails now, not after calibrating
    if source.trace and workflows is not None:
        fail(f"--workflows applies to generated workloads; {workload} is a trace, replayed whole "
             f"({replayed} workflows)")
    with exit_on_error():
        # refused before calibrating: beside a given --device-tokens the unset tiers take the real
        # engine's defaults (hf_capacities: host_ratio x, 8 x device; calibrate writes ratio 2),
        # without one simcheck sizes none (`simcheck.pressured`)
        loaded = load_profile(profile) if profile is not None else None  # a bad --profile fails now
        if device_tokens is not None:
            ratio = loaded.host_ratio if loaded is not None else 2.0
            caps = CacheConfig(device_tokens, host_tokens, disk_tokens).resolve(
                CapacityDefaults(device_tokens, host_ratio=ratio, disk_ratio=8))
        else:
            caps = Capacities(1, host_tokens or 0, disk_tokens or 0)
        check_load_rule(load_rule, caps)
        if loaded is not None:
            name = loaded.name
            caption = f"profile {name}" + (f" ({profile})" if profile != name else "")
        else:
            profile = str(out / "profile.json")
            console.print(f"calibrating {model} -> {profile}", markup=False)
            run_calibrate(hf, Path(profile))
            caption = f"the profile calibrated now ({profile})"
        rows = run_simcheck(source, names, lanes, hf, profile,
                            CacheConfig(device_tokens, host_tokens, disk_tokens), PredictorSource(train=strs(train)),
                            out, progress=lambda r: console.print(f"  {r['policy']} done"),
                            note=lambda line: console.print(escape(line), style="yellow"))
    first = rows[0]
    print_whole(console, table(rows, f"{workload} x{replayed}, concurrency {concurrency}, {model}, scale {scale:g}"
                               + (f" (outputs {output_scale:g})" if output_scale else "") + "; "
                               f"KV tokens device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                               f"disk {first['disk_tokens']:,}", caption))
    if load_rule == "auto" and (first["host_tokens"] or first["disk_tokens"]):
        console.print("note: the simulator always loads host/disk prefixes back; the real engine (--load-rule "
                      "auto) recomputes one when it estimates that faster (--load-rule load: both load)")
    out.mkdir(parents=True, exist_ok=True)
    for line in verdict(rows):
        console.print(line)
    save_json(out / "simcheck.json", rows)
    console.print(f"results: {out / 'simcheck.json'}", markup=False)


def policy_list(value: str) -> list[str]:
    """simcheck's --policies: at least one, each once, each a known policy (exit 2 otherwise,
    before anything is calibrated or replayed)."""
    from pbkv.policy.registry import policy_class
    names = distinct("--policies", split(value))
    if not names:
        fail("--policies: give at least one policy")
    with exit_on_error():
        for name in names:
            policy_class(name)
    return names

