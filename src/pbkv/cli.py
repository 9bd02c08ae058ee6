"""The `pbkv` command: bench, gen, trace stats, perf."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Prediction-based KV-cache management for LLM agent workflows.")
trace_app = typer.Typer(no_args_is_help=True, help="Inspect workflow traces.")
perf_app = typer.Typer(no_args_is_help=True, help="Speed figures of the simulator and the cache.")
app.add_typer(trace_app, name="trace")
app.add_typer(perf_app, name="perf")
# Tables need ~110 columns; a narrower (or piped) output still gets them whole.
console = Console(width=max(110, shutil.get_terminal_size((110, 24)).columns))

DEFAULT_WORKLOADS = "hover,swe,finance,dialogue"


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _concurrency(value: str) -> list[int | None]:
    out = []
    for v in _split(value):
        if v == "open":
            out.append(None)
        elif v.isdigit() and int(v) > 0:
            out.append(int(v))
        else:
            _fail(f"--concurrency: expected positive integers or 'open', got {v!r}")
    return out


PREDICTOR_HELP = "Policies that predict (pbkv*) need a predictor: trained on --train traces, loaded from --model, or (generated workloads) trained on the generator with seed + 1."


@app.command()
def bench(
    workload: str = typer.Option(DEFAULT_WORKLOADS, help="Built-in workload names or spec files, comma-separated."),
    trace: Optional[list[Path]] = typer.Option(None, help="Replay these trace files instead of generating (repeatable)."),
    policies: str = typer.Option("lru,kvflow,continuum,scalesim,arc,slru,pbkv,oracle", help="Policies to compare, comma-separated (LRU and the oracle are always added)."),
    concurrency: str = typer.Option("64", help="Concurrent workflows to sweep ('open': by trace t)."),
    pressure: str = typer.Option("auto", help="Device capacity as a fraction of the replay's distinct prompt tokens, comma-separated (e.g. 0.02,0.05,0.1); 'auto': chosen from each workload's working set (the default run's regimes); 'profile': the profile's device. --device-tokens wins."),
    tiers: str = typer.Option("auto", help="Tier sets to run, comma-separated: device (vLLM-like), device+host (host 2x device, HiCache-like), device+host+disk; 'auto': the default run's pairs with --pressure auto, else the profile's tiers."),
    profile: str = typer.Option("a6000-qwen3-32b", help="Built-in profile name or a profile JSON file."),
    device_tokens: Optional[int] = typer.Option(None, min=1, help="Device KV capacity in tokens (default: from the profile)."),
    host_tokens: Optional[int] = typer.Option(None, min=0, help="Host KV capacity (default: profile host_ratio x device)."),
    disk_tokens: Optional[int] = typer.Option(None, min=0, help="Disk KV capacity (default: the profile's)."),
    workflows: int = typer.Option(400, min=1, help="Workflows per generated workload."),
    seed: int = typer.Option(0, help="Seed of the generated workloads."),
    train: Optional[list[Path]] = typer.Option(None, help="Train the predictor on these traces (repeatable). " + PREDICTOR_HELP),
    model: Optional[Path] = typer.Option(None, help="Load the predictor saved by `pbkv train`."),
    horizon: Optional[int] = typer.Option(None, min=1, help="Prediction horizon K (default: the predictor's; 3 when training)."),
    online: bool = typer.Option(False, help="Retrain the predictor from finished workflows during the run."),
    engine: str = typer.Option("sim", help="Engine: 'sim' (the discrete-event simulator), 'hf' (a real transformers model, wall-clock time) or 'vllm' (a real vLLM alone (policy 'vllm') and with pbkv's connector per policy; docs/vllm.md)."),
    model_path: str = typer.Option("tiny", help="--engine hf: 'tiny' (random small Llama), 'smollm2' (needs pbkv\\[smollm2]) or a local model directory."),
    scale: float = typer.Option(1.0, help="--engine hf: divide every prompt and output length by this (prefix sharing kept)."),
    output_scale: Optional[float] = typer.Option(None, help="--engine hf: divide output lengths by this instead (default: --scale)."),
    load_rule: str = typer.Option("auto", help="--engine hf: host/disk prefixes: auto (load if estimated faster than recompute), load, recompute."),
    threads: int = typer.Option(1, min=1, help="--engine hf: torch CPU threads."),
    vllm_python: Optional[Path] = typer.Option(None, help="--engine vllm: python of the venv with vLLM (default: .venv-vllm/bin/python; see docs/vllm.md)."),
    jobs: int = typer.Option(2, min=1, help="Parallel worker processes."),
    out: Path = typer.Option(Path("results/bench"), help="Folder for the JSON, PNG plots and trained predictors."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="JSON path (default: OUT/bench.json)."),
):
    """Compare cache policies side by side on workloads or traces; print a table, save JSON and plots."""
    hf = None
    if engine == "hf":
        hf = _hf_config(model_path, scale, output_scale, load_rule, threads, seed)
    vllm = None
    if engine == "vllm":
        hf = _hf_config(model_path, scale, output_scale, load_rule, threads, seed)  # same checks
        vllm = _vllm_config(vllm_python, model_path, scale, output_scale, device_tokens, host_tokens, disk_tokens,
                            seed)
    _run_bench(workload, trace, _split(policies), concurrency, profile, device_tokens, host_tokens, disk_tokens,
               workflows, seed, train, model, horizon, online, engine, jobs, out, json_path, hf=hf, vllm=vllm,
               regimes=_regime_args(pressure, tiers))


def _regime_args(pressure: str, tiers: str) -> dict:
    """--pressure and --tiers, validated (clear error, exit 2)."""
    from pbkv.bench.regimes import parse_pressures, parse_tiers
    try:
        press = pressure if pressure == "auto" else None if pressure == "profile" else parse_pressures(pressure)
        return {"pressures": press, "tiers": [] if tiers == "auto" else parse_tiers(tiers)}
    except ValueError as e:
        _fail(str(e))


def _vllm_config(python, model_path, scale, output_scale, device_tokens, host_tokens, disk_tokens, seed):
    """--engine vllm: find the vLLM venv's python (clear error, exit 2) and size vLLM and the connector."""
    from dataclasses import replace

    from pbkv.bench.vllm_run import BLOCK, VLLMConfig, VLLMRunError, find_python
    try:
        cfg = VLLMConfig(python=find_python(str(python) if python else None), scale=scale,
                         output_scale=output_scale, seed=seed,
                         model=None if model_path in ("tiny", "smollm2") else model_path)
    except VLLMRunError as e:
        _fail(str(e))
    if device_tokens is not None:
        cfg = replace(cfg, blocks=-(-device_tokens // BLOCK))
    if host_tokens is not None:
        cfg = replace(cfg, host_tokens=host_tokens)
    if disk_tokens is not None:
        cfg = replace(cfg, disk_tokens=disk_tokens)
    return cfg


def _hf_config(model_path, scale, output_scale, load_rule, threads, seed):
    """The real engine's settings from the command line, validated (clear error, exit 2)."""
    from pbkv.bench.hf_run import HFConfig
    from pbkv.engine.hf.engine import LOAD_RULES
    if not scale >= 1:
        _fail(f"--scale: must be >= 1, got {scale}")
    if output_scale is not None and not output_scale >= 1:
        _fail(f"--output-scale: must be >= 1, got {output_scale}")
    if load_rule not in LOAD_RULES:
        _fail(f"--load-rule: expected one of {', '.join(LOAD_RULES)}, got {load_rule!r}")
    return HFConfig(model_path=model_path, scale=scale, output_scale=output_scale, load_rule=load_rule,
                    threads=threads, seed=seed)


@app.command()
def ablate(
    workload: str = typer.Option("hover,swe,finance", help="Built-in workload names or spec files, comma-separated."),
    trace: Optional[list[Path]] = typer.Option(None, help="Replay these trace files instead (needs --train or --model)."),
    concurrency: str = typer.Option("64,96,128", help="Concurrent workflows to sweep."),
    profile: str = typer.Option("a6000-qwen3-32b", help="Built-in profile name or a profile JSON file."),
    device_tokens: Optional[int] = typer.Option(None, min=1),
    host_tokens: Optional[int] = typer.Option(None, min=0),
    workflows: int = typer.Option(400, min=1),
    seed: int = typer.Option(0),
    train: Optional[list[Path]] = typer.Option(None, help="Train predictors on these traces (repeatable)."),
    horizon: Optional[int] = typer.Option(None, min=1),
    jobs: int = typer.Option(2, min=1),
    out: Path = typer.Option(Path("results/ablate")),
):
    """The ablation table in one command: lru, kvflow, pbkv-retired, pbkv-noprefetch, pbkv-history,
    pbkv-context, pbkv, oracle, side by side."""
    from pbkv.bench.main import ABLATION
    _run_bench(workload, trace, ABLATION, concurrency, profile, device_tokens, host_tokens, None, workflows, seed,
               train, None, horizon, False, "sim", jobs, out, None)


def _run_bench(workload, trace, policies, concurrency, profile, device_tokens, host_tokens, disk_tokens, workflows,
               seed, train, model, horizon, online, engine, jobs, out, json_path, hf=None, vllm=None,
               regimes=None) -> None:
    from pbkv.bench.main import BenchArgs, run
    from pbkv.bench.predictors import PredictorSource
    from pbkv.bench.sweep import source_from_arg
    from pbkv.policy import UnknownPolicy
    from pbkv.trace import TraceError

    if engine not in ("sim", "hf", "vllm"):
        _fail(f"--engine: unknown engine {engine!r}; available: sim, hf, vllm")
    for path in [*(trace or []), *(train or [])] + ([model] if model else []):
        if not path.exists():
            _fail(f"{path}: no such file or directory")
    sources = ([source_from_arg(str(t), workflows, seed) for t in trace] if trace
               else [source_from_arg(w, workflows, seed) for w in _split(workload)])
    options = {"horizon": horizon} if horizon else {}
    if online:
        options.update(online=True, train_files=[str(t) for t in train or []])
    args = BenchArgs(sources=sources, policies=policies, concurrency=_concurrency(concurrency), profile=profile,
                     device_tokens=device_tokens, host_tokens=host_tokens, disk_tokens=disk_tokens, jobs=jobs,
                     out=out, json_path=json_path, options=options, engine=engine, hf=hf, vllm=vllm, **(regimes or {}),
                     predictor=PredictorSource(model=str(model) if model else None,
                                               train=tuple(str(t) for t in train or []), horizon=horizon or 3))
    try:
        run(args, console)
    except (UnknownPolicy, TraceError, ValueError) as e:
        _fail(str(e))
    except RuntimeError as e:  # the real engine: a model that cannot load, an engine stuck
        from pbkv.bench.vllm_run import VLLMRunError
        from pbkv.engine.hf import EngineError, ModelLoadError
        if isinstance(e, VLLMRunError):  # a worker's stderr tail: no rich markup
            from rich.markup import escape
            _fail(escape(str(e)))
        if isinstance(e, (ModelLoadError, EngineError)):
            _fail(str(e))
        raise


@app.command()
def gen(
    workload: Optional[str] = typer.Argument(None, help="Built-in workload name (or use --spec)."),
    spec: Optional[Path] = typer.Option(None, help="A workflow spec file (YAML or JSON)."),
    workflows: int = typer.Option(100, min=1, help="Number of workflows."),
    seed: int = typer.Option(0, help="Random seed."),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write (.jsonl or .jsonl.gz)."),
):
    """Generate a workflow trace (TRACE_FORMAT v1) from a built-in workload or a spec file."""
    from pbkv.trace import write_trace
    from pbkv.workloads import builtin_names, generate, load_spec

    if (workload is None) == (spec is None):
        _fail(f"give a built-in workload ({', '.join(builtin_names())}) or --spec FILE, not both")
    try:
        s = load_spec(str(spec) if spec else workload)
    except (ValueError, OSError) as e:
        _fail(str(e))
    trace = generate(s, workflows, seed)
    write_trace(trace, output)
    console.print(f"wrote {len(trace.calls)} calls of {workflows} workflows to {output}")


@trace_app.command("stats")
def trace_stats_cmd(
    file: Path = typer.Argument(..., help="Trace file."),
    heldout: Optional[Path] = typer.Option(None, help="Score a Markov next-agent predictor fit on FILE on this trace."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the figures as JSON."),
):
    """Print what STATS.md reports: sizes, lengths, prefix reuse, next-agent entropy, Markov top-1."""
    from pbkv.trace import TraceError, read_trace
    from pbkv.trace.stats import format_stats, trace_stats

    try:
        stats = trace_stats(read_trace(file), read_trace(heldout) if heldout else None)
    except TraceError as e:
        _fail(str(e))
    print(format_stats(stats))
    if json_path:
        json_path.write_text(json.dumps(stats, indent=1) + "\n")


@trace_app.command("split")
def trace_split_cmd(
    file: Path = typer.Argument(..., help="Trace file."),
    train_out: Path = typer.Option(..., "--train-out", help="Where the first part goes."),
    test_out: Path = typer.Option(..., "--test-out", help="Where the held-out part goes."),
    test_fraction: float = typer.Option(0.5, min=0.0, max=1.0, help="Share of task groups held out."),
    seed: int = typer.Option(0),
):
    """Split a trace by task (no task in both parts), e.g. to train on one half and replay the other."""
    from pbkv.trace import TraceError, read_trace, write_trace
    from pbkv.trace.transform import split_by_task

    try:
        train, test = split_by_task(read_trace(file), test_fraction, seed)
    except TraceError as e:
        _fail(str(e))
    write_trace(train, train_out)
    write_trace(test, test_out)
    console.print(f"{len(train.workflows())} workflows -> {train_out}; {len(test.workflows())} workflows -> {test_out}")


@trace_app.command("flatten")
def trace_flatten_cmd(
    file: Path = typer.Argument(..., help="Trace file."),
    output: Path = typer.Option(..., "-o", "--output", help="Trace file to write."),
):
    """Make every call its own workflow: the same prompts with no workflow structure."""
    from pbkv.trace import TraceError, read_trace, write_trace
    from pbkv.trace.transform import flatten

    try:
        trace = flatten(read_trace(file))
    except TraceError as e:
        _fail(str(e))
    write_trace(trace, output)
    console.print(f"wrote {len(trace.calls)} one-call workflows to {output}")


@perf_app.command("sim")
def perf_sim(
    workload: str = typer.Option("hover", help="Built-in workload."),
    workflows: int = typer.Option(2000, min=1),
    concurrency: int = typer.Option(64, min=1),
    policy: str = typer.Option("lru"),
    model: Optional[Path] = typer.Option(None, help="Predictor saved by `pbkv train` (for pbkv policies)."),
):
    """Calls simulated per minute (target >= 100,000)."""
    from pbkv.bench.perf import sim_speed
    try:
        r = sim_speed(workload, workflows, concurrency, policy, str(model) if model else None)
    except ValueError as e:
        _fail(str(e))
    console.print(f"{r['calls']} calls in {r['seconds']:.2f} s: {r['calls_per_minute']:,.0f} calls simulated per minute "
                  f"({workload}, {policy}, concurrency {concurrency}; generation not counted)")


@perf_app.command("policy")
def perf_policy(
    workload: str = typer.Option("hover", help="Built-in workload."),
    policy: str = typer.Option("pbkv"),
    model: Optional[Path] = typer.Option(None, help="Predictor saved by `pbkv train` (for pbkv policies)."),
    workflows: int = typer.Option(600, min=1),
    concurrency: int = typer.Option(160, min=1),
    device_tokens: Optional[int] = typer.Option(None, min=1),
    host_tokens: Optional[int] = typer.Option(0, min=0),
):
    """Wall time of policy decisions vs simulated run time (target <= 5%); predictions made live."""
    from pbkv.bench.perf import policy_overhead
    try:
        r = policy_overhead(workload, policy, str(model) if model else None, workflows, concurrency,
                            device_tokens, host_tokens)
    except ValueError as e:
        _fail(str(e))
    console.print(f"{policy} on {workload} (concurrency {concurrency}): {r['policy_seconds']:.2f} s of policy decisions "
                  f"for {r['calls']} calls ({r['us_per_call']:.0f} us per call) in a simulated run of "
                  f"{r['makespan_s']:,.0f} s: {r['overhead'] * 100:.3f}% added")


@perf_app.command("evict")
def perf_evict(nodes: int = typer.Option(100_000, min=1100), policy: str = typer.Option("lru"),
               model: Optional[Path] = typer.Option(None, help="Predictor saved by `pbkv train` (pbkv policies; default: a Markov predictor fitted on the synthetic workflows).")):
    """Eviction cost per evicted node in a tree of NODES nodes with live workflows (target <= 50 us)."""
    from pbkv.bench.perf import evict_speed
    from pbkv.policy import UnknownPolicy
    try:
        r = evict_speed(nodes, policy, model=str(model) if model else None)
    except (UnknownPolicy, ValueError) as e:
        _fail(str(e))
    used = f"; predictor: {r['predictor']}" if r["predictor"] else ""
    console.print(f"{r['evicted']} nodes evicted from a {r['nodes']:,}-node tree in {r['seconds'] * 1e3:.1f} ms: "
                  f"{r['us_per_node']:.1f} us per evicted node ({policy}{used})")


def _train_bar():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


def _check_predictor_args(horizon: int, variant: str | None = None) -> None:
    from pbkv.predict.model import VARIANTS
    if horizon < 1:
        _fail(f"--horizon: must be >= 1, got {horizon}")
    if variant is not None and variant not in VARIANTS:
        _fail(f"--variant: unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")


@app.command("train")
def train_cmd(
    trace: list[Path] = typer.Option(..., "--trace", help="Training trace file (repeatable)."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory to write the predictor to."),
    horizon: int = typer.Option(3, help="Steps predicted ahead (K)."),
    variant: str = typer.Option("fused", help="fused | history | context."),
    epochs: Optional[int] = typer.Option(None, min=1, help="Training epochs (default: about 2,500 steps)."),
    seed: int = typer.Option(0, help="Random seed (training is deterministic given it)."),
):
    """Train a workflow predictor (next K agents + survival) on traces and save it as a directory."""
    from pbkv.predict import save_predictor, train_predictor
    from pbkv.trace import TraceError, read_trace

    _check_predictor_args(horizon, variant)
    try:
        traces = [read_trace(t) for t in trace]
        with _train_bar() as bar:
            task = bar.add_task(f"training {variant}", total=None)
            p = train_predictor(traces, variant=variant, horizon=horizon, epochs=epochs, seed=seed,
                                progress=lambda done, total: bar.update(task, completed=done, total=total))
        save_predictor(p, output)
    except (TraceError, ValueError, OSError) as e:
        _fail(str(e))
    info = p.info
    top1 = info.get("train_top1_k1")
    console.print(f"{info['parameters']:,} parameters, {len(p.agents)} agents, {info['samples']} samples, "
                  f"{info['epochs']} epochs, trained in {info['train_seconds']:.1f} s; train-set top-1 (k=1) "
                  f"{'n/a' if top1 is None else f'{top1:.3f}'}")
    console.print(f"saved: {output}")


@app.command("predict-eval")
def predict_eval_cmd(
    model: Optional[Path] = typer.Option(None, help="A saved predictor directory (evaluated with its stored Markov baseline)."),
    trace: Optional[Path] = typer.Option(None, help="Trace to evaluate on (with --model), or to --split."),
    train: Optional[Path] = typer.Option(None, help="Train the fused/history/context predictors and Markov on this trace."),
    test: Optional[Path] = typer.Option(None, help="... and evaluate them on this one."),
    split: bool = typer.Option(False, help="Split --trace by task (50/50): train on one half, test on the other."),
    horizon: int = typer.Option(3, help="Steps predicted ahead when training."),
    epochs: Optional[int] = typer.Option(None, min=1, help="Training epochs when training."),
    seed: int = typer.Option(0, help="Seed of training and of the split."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the figures as JSON."),
):
    """Top-1 accuracy at k=1..K, end-of-workflow accuracy, ECE and speed of predictors, next to Markov."""
    from pbkv.predict import evaluate, fit_markov, load_predictor, split_by_task, train_predictor
    from pbkv.trace import TraceError, read_trace

    _check_predictor_args(horizon)
    rows: list[tuple[str, str, dict]] = []  # (label, JSON key prefix, metrics)
    try:
        if model is not None:
            if trace is None or train is not None or test is not None:
                _fail("with --model give --trace FILE (and optionally --split to score its test half)")
            p = load_predictor(model)
            data = read_trace(trace)
            if split:
                data = split_by_task(data, 0.5, seed)[1]
            rows.append((p.name, "", evaluate(p, data)))
            if p.markov is not None:
                rows.append(("markov", "markov_", evaluate(p.markov, data)))
        else:
            if train is not None and test is not None and trace is None:
                fit, data = read_trace(train), read_trace(test)
            elif trace is not None and split and train is None and test is None:
                fit, data = split_by_task(read_trace(trace), 0.5, seed)
            else:
                _fail("give --model DIR --trace FILE, or --train FILE --test FILE, or --trace FILE --split")
            with _train_bar() as bar:
                for variant, label, prefix in (("fused", "fused", ""), ("history", "history-only", "history_"),
                                               ("context", "context-only", "context_")):
                    task = bar.add_task(f"training {variant}", total=None)
                    p = train_predictor(fit, variant=variant, horizon=horizon, epochs=epochs, seed=seed,
                                        progress=lambda d, t, task=task: bar.update(task, completed=d, total=t))
                    m = evaluate(p, data)
                    m["train_seconds"], m["parameters"] = p.info["train_seconds"], p.info["parameters"]
                    rows.append((label, prefix, m))
            rows.append(("markov", "markov_", evaluate(fit_markov(fit, horizon), data)))
    except (TraceError, ValueError, OSError) as e:
        _fail(str(e))
    _print_predict_table(rows)
    if json_path:
        out = {prefix + k: v for _, prefix, m in rows for k, v in m.items()}
        json_path.write_text(json.dumps(out, indent=1, default=float) + "\n")
        console.print(f"results: {json_path}")


def _print_predict_table(rows) -> None:
    from rich.table import Table

    k = max(int(key[6:]) for _, _, m in rows for key in m if key.startswith("top1_k"))
    table = Table(title=f"next-agent prediction ({rows[0][2]['calls']} positions)")
    for col in ["predictor"] + [f"top1@k{i}" for i in range(1, k + 1)] + ["end acc", "ECE", "us/call"]:
        table.add_column(col, justify="left" if col == "predictor" else "right")

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)
    for label, _, m in rows:
        table.add_row(label, *[f(m.get(f"top1_k{i}")) for i in range(1, k + 1)], f(m["end_acc"]), f(m["ece"]),
                      f(m["us_per_call"], "{:.0f}"))
    console.print(table)



@app.command()
def serve(
    model: str = typer.Option("tiny", help="'tiny' (random small Llama, byte tokenizer), 'smollm2' (needs pbkv\\[smollm2]) or a local model directory."),
    policy: str = typer.Option("pbkv", help="Cache policy: lru, kvflow, pbkv (or a variant, or package.module:Class)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default; set --api-key before exposing it)."),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: Optional[str] = typer.Option(None, envvar="PBKV_API_KEY", help="Require 'Authorization: Bearer KEY' (env PBKV_API_KEY)."),
    served_name: Optional[str] = typer.Option(None, help="Model id clients send (default: the model's name)."),
    record: Optional[Path] = typer.Option(None, help="Write served calls as TRACE_FORMAT v1 traces into this folder."),
    record_rotate: int = typer.Option(10_000, min=1, help="Calls per trace file before the next one starts."),
    record_context: bool = typer.Option(False, help="Also record each call's latest message (as `context`)."),
    model_dir: Optional[Path] = typer.Option(None, help="Predictor directory: loaded at start (if present), saved on shutdown."),
    online: bool = typer.Option(True, help="Retrain the predictor from ended workflows while serving."),
    learn_every: int = typer.Option(50, min=1, help="Retrain after this many ended workflows."),
    learn_steps: int = typer.Option(300, min=1, help="Optimiser steps per retrain."),
    learn_nice: int = typer.Option(10, min=0, max=19, help="Niceness of the retrain process (0: an equal CPU share; it slows serving while it runs)."),
    idle_timeout: float = typer.Option(300.0, min=0.001, help="Seconds without calls after which a workflow ends."),
    device_tokens: int = typer.Option(16384, min=1, help="Device KV capacity in tokens."),
    host_tokens: Optional[int] = typer.Option(None, min=0, help="Host KV capacity (default 2 x device)."),
    disk_tokens: Optional[int] = typer.Option(None, min=0, help="Disk KV capacity (default 4 x device)."),
    disk_dir: Optional[Path] = typer.Option(None, help="Folder for disk-tier KV files (default: a temporary folder)."),
    max_tokens_limit: int = typer.Option(1024, min=1, help="Largest max_tokens a request may ask for."),
    default_max_tokens: int = typer.Option(256, min=1, help="max_tokens when a request gives none."),
    max_body_bytes: int = typer.Option(1 << 20, min=1, help="Largest request body."),
    max_queue: int = typer.Option(1024, min=1, help="Requests in flight before new ones get 429."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads (1 is fastest for small models on a shared CPU)."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /metrics) on the real
    engine, with workflow hints (workflow_id, agent, workflow_done; X-Workflow-Id, X-Agent)."""
    try:
        from pbkv.serve import ServeConfig, run
    except ImportError as e:
        _fail(f"pbkv serve needs the serve extra ({e.name} is missing): pip install 'pbkv\\[serve]'")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(f"[yellow]warning:[/yellow] binding {host} without --api-key: anyone who reaches it can use it")
    cfg = ServeConfig(model=model, policy=policy, host=host, port=port, api_key=api_key, served_name=served_name,
                      record=str(record) if record else None, record_rotate=record_rotate,
                      record_context=record_context, model_dir=str(model_dir) if model_dir else None,
                      online=online, learn_every=learn_every, learn_steps=learn_steps,
                      learn_nice=learn_nice, idle_timeout=idle_timeout,
                      device_tokens=device_tokens, host_tokens=host_tokens, disk_tokens=disk_tokens,
                      disk_dir=str(disk_dir) if disk_dir else None, max_tokens_limit=max_tokens_limit,
                      default_max_tokens=default_max_tokens, max_body_bytes=max_body_bytes, max_queue=max_queue,
                      threads=threads)
    try:
        run(cfg, log_level=log_level)
    except (ValueError, OSError) as e:
        _fail(str(e))
    except RuntimeError as e:
        from pbkv.engine.hf import ModelLoadError
        if isinstance(e, ModelLoadError):
            _fail(str(e))
        raise

MODEL_PATH_HELP = "'tiny' (random small Llama), 'smollm2' (needs pbkv\\[smollm2]) or a local model directory."


@app.command()
def calibrate(
    model_path: str = typer.Option("tiny", help=MODEL_PATH_HELP),
    output: Path = typer.Option(..., "-o", "--output", help="Profile JSON to write (for --profile FILE)."),
    max_len: int = typer.Option(512, min=32, help="Longest prompt measured, in tokens."),
    repeats: int = typer.Option(2, min=1, help="Runs per measurement (the best counts)."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads (as the real engine will run)."),
):
    """Measure the real engine here (prefill vs prompt and cached prefix, decode step vs context, host copy
    and disk read bandwidth) and write a simulator profile."""
    from pbkv.bench.hf_run import HFConfig
    from pbkv.bench.simcheck import calibrate as run_calibrate
    from pbkv.engine.hf import ModelLoadError

    try:
        prof = run_calibrate(HFConfig(model_path=model_path, threads=threads), output, max_len, repeats)
    except (ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))
    for line in prof["sources"][:-1]:
        console.print(line)
    console.print(f"profile: {output}")


@app.command()
def simcheck(
    model_path: str = typer.Option("tiny", help=MODEL_PATH_HELP),
    profile: Optional[Path] = typer.Option(None, help="Calibrated profile JSON (default: calibrate now into OUT/profile.json)."),
    workload: str = typer.Option("hover", help="A built-in workload name, spec file or trace file."),
    workflows: int = typer.Option(8, min=1),
    concurrency: int = typer.Option(4, min=1),
    policies: str = typer.Option("lru,kvflow,pbkv,oracle"),
    scale: float = typer.Option(8.0, help="Divide every length by this (prefix sharing kept)."),
    output_scale: Optional[float] = typer.Option(None, help="Divide output lengths by this instead (default: --scale)."),
    device_tokens: Optional[int] = typer.Option(None, min=1, help="Default: 8 x the longest scaled call."),
    host_tokens: Optional[int] = typer.Option(None, min=0),
    disk_tokens: Optional[int] = typer.Option(None, min=0),
    load_rule: str = typer.Option("auto", help="auto, load or recompute (host/disk prefixes)."),
    train: Optional[list[Path]] = typer.Option(None, help="Traces to train the predictor on (needed to replay a trace file)."),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, min=1),
    out: Path = typer.Option(Path("results/simcheck"), help="Folder for profile.json, simcheck.json, predictors."),
):
    """Replay one small workload on the real engine and on the simulator (calibrated profile), per policy,
    and print both side by side."""
    from pbkv.bench.predictors import PredictorSource
    from pbkv.bench.simcheck import calibrate as run_calibrate
    from pbkv.bench.simcheck import simcheck as run_simcheck
    from pbkv.bench.simcheck import table, verdict
    from pbkv.bench.sweep import source_from_arg
    from pbkv.engine.hf import EngineError, ModelLoadError
    from pbkv.policy import UnknownPolicy
    from pbkv.trace import TraceError

    hf = _hf_config(model_path, scale, output_scale, load_rule, threads, seed)
    try:
        if profile is None:
            profile = out / "profile.json"
            console.print(f"calibrating {model_path} -> {profile}")
            run_calibrate(hf, profile)
        rows = run_simcheck(source_from_arg(workload, workflows, seed), _split(policies), concurrency, hf,
                            str(profile), {"device_tokens": device_tokens, "host_tokens": host_tokens,
                                           "disk_tokens": disk_tokens},
                            PredictorSource(train=tuple(str(t) for t in train or [])), out,
                            progress=lambda r: console.print(f"  {r['policy']} done"))
    except (UnknownPolicy, TraceError, ValueError, OSError, ModelLoadError, EngineError) as e:
        _fail(str(e))
    first = rows[0]
    console.print(table(rows, f"{workload} x{workflows}, concurrency {concurrency}, {model_path}, scale {scale:g}"
                        + (f" (outputs {output_scale:g})" if output_scale else "") + "; "
                              f"KV tokens device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                              f"disk {first['disk_tokens']:,}"))
    out.mkdir(parents=True, exist_ok=True)
    for line in verdict(rows):
        console.print(line)
    (out / "simcheck.json").write_text(json.dumps(rows, indent=1) + "\n")
    console.print(f"results: {out / 'simcheck.json'}")


if __name__ == "__main__":
    app()
