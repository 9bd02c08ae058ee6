"""`pbkv bench` and `pbkv ablate` behind the command line: validate, prepare, sweep, report."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pbkv.bench import predictors as predictors_mod
from pbkv.bench.report import earlier_plots, print_tables, remove_plots, write_json, write_plots
from pbkv.bench.regimes import check_tiers
from pbkv.bench.runner import check_fits
from pbkv.bench.verdict import verdicts
from pbkv.bench.sweep import SweepConfig, check_names, load_workload, pressure_notes, run_sweep, sweep_jobs
from pbkv.driver.replay import check_arrivals
from pbkv.engine.profiles import load_profile
from pbkv.policy.registry import policy_class
from pbkv.predict.base import check_agent_names

ABLATION = ["lru", "kvflow", "pbkv-retired", "pbkv-noprefetch", "pbkv-history", "pbkv-context", "pbkv", "oracle"]


@dataclass
class BenchArgs(SweepConfig):
    """A sweep plus where its results go and where its predictors come from."""

    out: Path = Path("results/bench")
    json_path: Path | None = None
    predictor: predictors_mod.PredictorSource = field(default_factory=predictors_mod.PredictorSource)


def check(args: BenchArgs) -> list[str]:
    """Validate names before any work; return the policy list with LRU and the oracle in it
    (on vLLM: with "vllm", vLLM alone, first; the oracle cannot run there)."""
    args.cache.check()   # an unreachable disk: refused before training, not in every worker
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.samples > 1 and args.engine != "sim":
        raise ValueError(f"--samples averages simulated runs (--engine sim), not --engine {args.engine}")
    if args.engine == "vllm":
        from pbkv.policy.registry import needs_future
        check_vllm(args)
        pols = [p for p in args.policies if p != "vllm"]
        for p in pols:
            policy_class(p)
        return ["vllm"] + [p for p in pols if not needs_future(p)]
    for p in args.policies:
        policy_class(p)
    check_tiers(args.tiers, args.cache.host_tokens, args.cache.disk_tokens)
    load_profile(args.profile)
    check_routers(args)
    pols = list(args.policies)
    if "lru" not in pols:
        pols.insert(0, "lru")      # every speedup is measured against LRU in the same run
    if "oracle" not in pols and args.router_runs() == [(1, None)]:
        # every one-instance report shows the perfect-knowledge reference (not behind a router:
        # each instance's oracle would see the whole trace's future, not the calls routed to it)
        pols.append("oracle")
    return pols


def check_vllm(args: BenchArgs) -> None:
    """--engine vllm runs one vLLM instance per setup at the sizes --device-tokens, --host-tokens
    and --disk-tokens give: the simulator's sweep options would be ignored (or, --router, rerun
    every setup into unlabelled duplicate rows), so each is refused (ValueError, exit 2)."""
    what = ("--engine vllm runs one vLLM instance per setup, sized by --device-tokens (its GPU pool), "
            "--host-tokens and --disk-tokens (the connector's RAM and disk tiers)")
    if args.tiers:
        raise ValueError(f"--tiers sets the simulator's tier sets (--engine sim); {what}")
    if args.pressures != "auto":
        raise ValueError(f"--pressure sizes the simulator's memory (--engine sim); {what}")
    if args.instance_counts() != [1] or args.routers:
        raise ValueError(f"--instances/--router run the simulator only (--engine sim); {what}")
    if args.shared_tokens:
        raise ValueError(f"--shared-tokens is a simulated shared tier (--engine sim); {what}")
    from pbkv.bench.vllm_run import BLOCK, VLLMConfig, min_blocks
    vcfg = (args.vllm or VLLMConfig()).with_cache(args.cache)
    if vcfg.blocks < min_blocks(vcfg):   # else vLLM refuses it at start, minutes in, in a traceback
        raise ValueError(f"--device-tokens {args.cache.device_tokens}: vLLM needs at least "
                         f"{min_blocks(vcfg) * BLOCK} ({min_blocks(vcfg)} blocks of {BLOCK} tokens: one "
                         f"{vcfg.max_model_len}-token request plus vLLM's null block)")
    if args.online:
        raise ValueError("--online retrains the predictor during simulated runs (--engine sim); --engine vllm "
                         "runs the connector on the predictor trained before the runs (--train / --predictor)")


def dropped_on_vllm(args: BenchArgs) -> list[str]:
    """The asked policies --engine vllm cannot run: those reading the trace's future (the oracle,
    pbkv-perfect): the connector sees requests one at a time, never the replay ahead."""
    from pbkv.policy.registry import needs_future
    return [p for p in args.policies if p != "vllm" and needs_future(p)]


def check_routers(args: BenchArgs) -> None:
    """Several instances: simulator only, a known router and link, at least one instance."""
    from pbkv.route import router_class
    from pbkv.scale.links import get_link
    if min(args.instance_counts()) < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    if args.router_runs() != [(1, None)] and args.engine != "sim":
        raise ValueError(f"--instances/--router run the simulator only (--engine sim), not {args.engine!r}")
    for r in args.routers:
        router_class(r)
    get_link(args.link)
    get_link(args.shared_link)
    if args.shared_tokens < 0:
        raise ValueError(f"--shared-tokens must be >= 0, got {args.shared_tokens}")
    if args.shared_tokens and args.router_runs() == [(1, None)]:
        raise ValueError("--shared-tokens needs --instances or --router (a shared tier of one instance is its disk)")
    block = max(load_workload(s).trace.block_size for s in args.sources)
    if 0 < args.shared_tokens < block:  # it would hold nothing, yet its record showed bytes written to it
        raise ValueError(f"--shared-tokens {args.shared_tokens} holds not one block of {block} tokens; give at "
                         f"least {block}, or 0 for no shared tier")


def run(args: BenchArgs, console: Console) -> list[dict]:
    pols = check(args)
    check_names(args.sources)
    trained = [p for p in pols if p != "vllm"]            # vLLM alone: not a pbkv policy
    predicting = bool(predictors_mod.variants_needed(trained))
    for s in args.sources:         # fail fast on a bad spec or trace, before any worker starts
        workload, name = load_workload(s), s.trace or s.name
        if not workload.workflows:
            raise ValueError(f"{name}: no calls to replay")
        if predicting:   # an agent "<end>" would be the workflow's end to the policy (and crash --online's retrain)
            check_agent_names([workload.trace])
        if None in args.concurrency and args.engine != "vllm":
            check_arrivals(workload.workflows, name)
        if args.engine == "sim" and args.cache.device_tokens is not None:
            check_fits(workload, args.cache.device_tokens)   # before training, not minutes into the run
        elif args.engine == "hf" and args.cache.device_tokens is not None:   # the scaled calls, as run_hf runs them
            from pbkv.bench.hf_run import HFConfig, scale_workload
            check_fits(scale_workload(workload, args.hf or HFConfig()), args.cache.device_tokens)
    if args.engine == "vllm":
        from pbkv.bench.vllm_run import VLLMConfig, skip_note
        vcfg = (args.vllm or VLLMConfig()).with_cache(args.cache)
        for note in [skip_note(load_workload(s), vcfg) for s in args.sources]:   # before any run
            if note:
                console.print(note, markup=False, highlight=False)
        if dropped_on_vllm(args):
            console.print(f"note: --engine vllm: {', '.join(dropped_on_vllm(args))} not run (they read the replay's "
                          f"future; the connector sees requests as they come)", markup=False, highlight=False)
    for line in check_given_predictor(args, trained):
        console.print(line, markup=False, highlight=False)
    for note in pressure_notes(args):   # a clamped --pressure runs more memory than asked: say so
        console.print(f"note: {note}", markup=False, highlight=False)
    partial = start_partial(args) if args.engine == "vllm" else None
    with _bar(console) as bar:
        task = bar.add_task("training predictors", total=None)
        paths = predictors_mod.prepare(args.sources, trained, args.predictor, args.out / "models",
                                       progress=lambda done, total: bar.update(task, completed=done, total=total),
                                       jobs=args.jobs)
        for line in trained_notes(args, paths):   # before the runs, as --predictor's notes
            console.print(line, markup=False, highlight=False)
        cfg = replace(args, policies=pols, predictors=paths)
        doing = {"sim": "simulating", "vllm": "running vLLM"}.get(args.engine, "running the model")
        jobs = sweep_jobs(cfg)           # sizing the regimes reads every workload: once
        bar.update(task, description=doing, completed=0, total=len(jobs))
        def done(r):
            bar.update(task, advance=1, description=f"{r['workload']} {r['policy']} c={r['concurrency']}"
                                                    + (f" {r['router']}" if "router" in r else ""))
            if partial is not None:
                partial.add(r)
        try:
            records = run_sweep(cfg, jobs=jobs, on_done=done)
        except BaseException:
            if partial is not None and partial.records:
                console.print(f"note: the {len(partial.records)} setup(s) that finished are kept in {partial.path}",
                              markup=False, highlight=False)
            raise
    _record_version(records, predictors_mod.version_name(cfg.predictors))
    print_tables(records, console)
    for line in online_notes(records, args):
        console.print(line, markup=False, highlight=False)
    lines = verdicts(records)
    for line in lines:
        console.print(line, markup=False, highlight=False)  # "[regime]" is text, not markup
    if lines and args.samples == 1 and args.engine == "sim":
        console.print("one sample per cell: a replay's latency moves by ~1% with a few tokens more memory "
                      "(pbkv.bench.samples); --samples 3 shows each speedup's range", highlight=False)
    if args.engine != "sim":   # --samples is the simulator's: here the caveat is the reader's only guard
        console.print(f"latencies are wall-clock, one run per cell: a busy machine (other processes, CPU "
                      f"frequency) moves them run to run, by over 10% on a shared CPU; read a small x{_base(args)} "
                      f"difference as noise, the computed-token column as the steadier figure", highlight=False)
    # OUT/bench.json always (beside the plots, so no earlier run's figures stay next to them), and
    # --json too when given
    earlier = earlier_plots(args.out)   # an earlier run's plots in OUT, by its bench.json
    paths = [write_json(records, p, finite=True) for p in dict.fromkeys([args.out / "bench.json", args.json_path]) if p]
    plots = write_plots(records, args.out)
    removed = remove_plots(earlier, plots)
    if partial is not None:
        partial.path.unlink(missing_ok=True)
    console.print("results: " + "\n         ".join(map(str, [*paths, *plots])), markup=False, highlight=False)
    if removed:
        console.print("removed an earlier run's plots (not of this run's workloads): "
                      + ", ".join(map(str, removed)), markup=False, highlight=False)
    return records


def _base(args) -> str:
    """The baseline the speedup column names (`report.vllm_table`: vLLM alone; else LRU)."""
    return "vLLM" if args.engine == "vllm" else "LRU"


class Partial:
    """--engine vllm: the records of the setups finished so far, rewritten to
    OUT/bench.partial.json as each finishes (each is minutes of vLLM: a failed or interrupted run
    keeps them); removed once OUT/bench.json is written. When the first setup finishes, an earlier
    run's OUT/bench.json and the plots of its workloads go (else a run failing later would leave
    them beside this run's partial file, looking like its results); a run failing before any
    setup finished leaves them as they were."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / "bench.partial.json"
        self.records: list[dict] = []

    def add(self, record: dict) -> None:
        from pbkv.bench.sweep import finish_records
        if not self.records:
            remove_plots(earlier_plots(self.out), keep=[])
            (self.out / "bench.json").unlink(missing_ok=True)
        self.records.append(record)
        write_json(finish_records(self.records), self.path, finite=True)


def start_partial(args: BenchArgs) -> Partial:
    """The vLLM run's `Partial`; an earlier run's OUT/bench.partial.json is removed."""
    partial = Partial(args.out)
    partial.path.unlink(missing_ok=True)
    return partial


def _record_version(records: list[dict], version: str | None) -> None:
    """Add `predictor_version` to the records of runs that read --predictor's (fused) predictor:
    bench.json says which version of a folder that keeps changing (a server saving into it) was
    benchmarked. Nothing is added without one, so other runs' records are unchanged."""
    from pbkv.policy.registry import needed_predictor
    if version is None:
        return
    for r in records:
        if r["policy"] != "vllm" and needed_predictor(r["policy"]) == "fused":
            r["predictor_version"] = version


def check_given_predictor(args: BenchArgs, policies: list[str]) -> list[str]:
    """Check `--predictor DIR` before any run (its variant, --horizon against its horizon: raises
    ValueError) and return notes on replayed agents it never saw. Nothing without --predictor, so
    the default run prints what it printed."""
    path = args.predictor.predictor
    if not path or "fused" not in predictors_mod.variants_needed(policies):
        return []
    predictor = predictors_mod.given_predictor(path, args.horizon)
    return predictors_mod.agent_notes(predictor, f"--predictor {path}", args.sources)


def trained_notes(args: BenchArgs, paths: dict) -> list[str]:
    """With --train FILE, the notes `check_given_predictor` gives for --predictor: replayed agents
    the predictor trained on FILE never saw (one predictor read: every variant learns the same
    agents from the same files). Nothing otherwise, so the default run prints what it printed."""
    trained = [path for (_, variant), path in paths.items()
               if not (args.predictor.predictor and variant == "fused")]
    if not args.predictor.train or not trained:
        return []
    label = f"--train {','.join(map(str, args.predictor.train))}"
    return predictors_mod.agent_notes(predictors_mod.load(trained[0]), label, args.sources)


def online_notes(records: list[dict], args: BenchArgs) -> list[str]:
    """With --online, one note per workload, policy and concurrency whose runs used no retrain
    (its memory regimes listed): they ran as the offline ones would, which their figures do not
    show (a retrain comes every `LEARN_EVERY` finished workflows and is used only when trained on
    as many workflows as the predictor it would replace)."""
    if not args.online:
        return []
    groups: dict[tuple, list[str]] = {}
    for r in records:
        if r.get("online_retrains") == 0:
            unused = r.get("online_retrains_unused", 0)
            why = (f"{unused} retrain(s) learned from fewer workflows than the predictor it started with"
                   if unused else f"{r['workflows']} workflows finished, a retrain comes every "
                                  f"{predictors_mod.LEARN_EVERY}")
            regime = " ".join(str(v) for v in (r.get("tiers"), r.get("pressure") and f"pressure {r['pressure']}")
                              if v)
            groups.setdefault((r["workload"], r["policy"], r["concurrency"], why), []).append(regime)
    notes = []
    for (workload, policy, concurrency, why), regimes in groups.items():
        regimes = [x for x in dict.fromkeys(regimes) if x]
        where = f" ({', '.join(regimes)})" if regimes else ""
        notes.append(f"note: --online: {workload} {policy} c={concurrency}{where}: no retrain "
                     f"was used ({why}); it ran as without --online")
    return notes


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)
