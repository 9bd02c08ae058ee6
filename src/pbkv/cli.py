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


@app.command()
def bench(
    workload: str = typer.Option(DEFAULT_WORKLOADS, help="Built-in workload names or spec files, comma-separated."),
    trace: Optional[list[Path]] = typer.Option(None, help="Replay these trace files instead of generating (repeatable)."),
    policies: str = typer.Option("lru,kvflow,oracle", help="Policies to compare, comma-separated."),
    concurrency: str = typer.Option("16,32,64,96", help="Concurrent workflows to sweep ('open': by trace t)."),
    profile: str = typer.Option("a6000-qwen3-32b", help="Built-in profile name or a profile JSON file."),
    device_tokens: Optional[int] = typer.Option(None, min=1, help="Device KV capacity in tokens (default: from the profile)."),
    host_tokens: Optional[int] = typer.Option(None, min=0, help="Host KV capacity (default: profile host_ratio x device)."),
    disk_tokens: Optional[int] = typer.Option(None, min=0, help="Disk KV capacity (default: the profile's)."),
    workflows: int = typer.Option(400, min=1, help="Workflows per generated workload."),
    seed: int = typer.Option(0, help="Seed of the generated workloads."),
    engine: str = typer.Option("sim", help="Engine: 'sim' (the discrete-event simulator)."),
    jobs: int = typer.Option(2, min=1, help="Parallel worker processes."),
    out: Path = typer.Option(Path("results/bench"), help="Folder for the JSON and PNG plots."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="JSON path (default: OUT/bench.json)."),
):
    """Compare cache policies side by side on workloads or traces; print a table, save JSON and plots."""
    from pbkv.bench.report import print_tables, write_json, write_plots
    from pbkv.bench.sweep import SweepConfig, run_sweep, source_from_arg
    from pbkv.engine.profiles import load_profile
    from pbkv.policy import UnknownPolicy, policy_names
    from pbkv.policy.registry import policy_class
    from pbkv.trace import TraceError

    if engine != "sim":
        _fail(f"--engine: unknown engine {engine!r}; available: sim")
    pols = _split(policies)
    try:
        for p in pols:
            policy_class(p)
        load_profile(profile)
    except (UnknownPolicy, ValueError) as e:
        _fail(str(e))
    if "lru" not in pols:
        pols.insert(0, "lru")  # every speedup is measured against LRU in the same run
    sources = ([source_from_arg(str(t), workflows, seed) for t in trace] if trace
               else [source_from_arg(w, workflows, seed) for w in _split(workload)])
    cfg = SweepConfig(sources=sources, policies=pols, concurrency=_concurrency(concurrency), profile=profile,
                      device_tokens=device_tokens, host_tokens=host_tokens, disk_tokens=disk_tokens, jobs=jobs)
    total = len(sources) * len(pols) * len(cfg.concurrency)
    try:
        _preload(sources)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("simulating", total=total)
            records = run_sweep(cfg, on_done=lambda r: bar.update(
                task, advance=1, description=f"{r['workload']} {r['policy']} c={r['concurrency']}"))
    except (TraceError, ValueError) as e:
        _fail(str(e))
    print_tables(records, console)
    path = write_json(records, json_path or out / "bench.json")
    plots = write_plots(records, out)
    console.print(f"results: {path}" + "".join(f"\n         {p}" for p in plots))


def _preload(sources) -> None:
    """Fail fast (before any worker starts) on a bad spec or trace."""
    from pbkv.bench.sweep import load_workload
    for s in sources:
        load_workload(s)


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


@perf_app.command("sim")
def perf_sim(
    workload: str = typer.Option("hover", help="Built-in workload."),
    workflows: int = typer.Option(2000, min=1),
    concurrency: int = typer.Option(64, min=1),
    policy: str = typer.Option("lru"),
):
    """Calls simulated per minute (target >= 100,000)."""
    from pbkv.bench.perf import sim_speed
    r = sim_speed(workload, workflows, concurrency, policy)
    console.print(f"{r['calls']} calls in {r['seconds']:.2f} s: {r['calls_per_minute']:,.0f} calls simulated per minute "
                  f"({workload}, {policy}, concurrency {concurrency}; generation not counted)")


@perf_app.command("evict")
def perf_evict(nodes: int = typer.Option(100_000, min=100), policy: str = typer.Option("lru")):
    """Eviction cost per evicted node in a tree of NODES nodes (target <= 50 us)."""
    from pbkv.bench.perf import evict_speed
    r = evict_speed(nodes, policy)
    console.print(f"{r['evicted']} nodes evicted from a {r['nodes']:,}-node tree in {r['seconds'] * 1e3:.1f} ms: "
                  f"{r['us_per_node']:.1f} us per evicted node ({policy})")


if __name__ == "__main__":
    app()
