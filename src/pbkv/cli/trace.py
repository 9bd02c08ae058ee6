"""`pbkv gen` and `pbkv trace stats|split|flatten|repair|import|export`: make and inspect workflow traces."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from pbkv.cli.common import (JsonOpt, OutputOpt, SeedOpt, TraceFileArg, WorkflowsOpt, check_outputs, console,
                             written_path, exit_on_error, fail, output_file, output_opt, save_json,
                             status_console)

trace_app = typer.Typer(no_args_is_help=True, help="Inspect, split, flatten, import and export workflow traces.")


def gen(
    output: OutputOpt,
    workload: Annotated[Optional[str], typer.Argument(help="Built-in workload name (or use --spec).")] = None,
    spec: Annotated[Optional[Path], typer.Option(help="A workflow spec file (YAML or JSON).")] = None,
    workflows: WorkflowsOpt = 100,
    seed: SeedOpt = 0,
):
    """Generate a workflow trace (docs/trace-format.md) from a built-in workload or a spec file."""
    from pbkv.trace import write_trace
    from pbkv.workloads import builtin_names, generate

    if (workload is None) == (spec is None):
        fail(f"give a built-in workload ({', '.join(builtin_names())}) or --spec FILE, not both")
    check_outputs([spec], {"-o": output})
    with exit_on_error():
        trace = generate(str(spec) if spec else workload, workflows, seed)  # its errors name the file
        write_trace(trace, output)
    status_console(output).print(f"wrote {len(trace.calls)} calls of {workflows} workflows to {output}",
                                 markup=False)  # a path is text: rich would read 'out[v2].jsonl' as markup


@trace_app.command("stats")
def trace_stats_cmd(
    file: TraceFileArg,
    heldout: Annotated[Optional[Path], typer.Option(
        help="Score a Markov next-agent predictor fit on FILE on this trace.")] = None,
    json_path: JsonOpt = None,
):
    """Sizes, lengths, prefix reuse, next-agent entropy, Markov top-1 of a trace."""
    from pbkv.trace import read_trace
    from pbkv.trace.stats import format_stats, trace_stats

    check_outputs([file, heldout], {"--json": json_path})

    with exit_on_error():
        stats = trace_stats(read_trace(file), read_trace(heldout) if heldout else None)
    print(format_stats(stats))
    if json_path:
        save_json(json_path, stats)


@trace_app.command("split")
def trace_split_cmd(
    file: TraceFileArg,
    train_out: Annotated[Path, typer.Option("--train-out", help="Where the first part goes.", callback=output_file, parser=written_path)],
    test_out: Annotated[Path, typer.Option("--test-out", help="Where the held-out part goes.",
                                           callback=output_file, parser=written_path)],
    test_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of task groups held out.")] = 0.5,
    seed: SeedOpt = 0,
):
    """Split a trace by task (no task in both parts), e.g. to train on one half and replay the other."""
    from pbkv.trace import read_trace, write_trace
    from pbkv.trace.transform import require_both_parts, split_by_task

    check_outputs([file], {"--train-out": train_out, "--test-out": test_out})

    with exit_on_error():
        train, test = split_by_task(read_trace(file), test_fraction, seed)
        if 0 < test_fraction < 1:  # 0 or 1 asks for an empty part
            require_both_parts(train, test, str(file))
        write_trace(train, train_out)
        write_trace(test, test_out)
    status_console(train_out, test_out).print(
        f"{len(train.workflows())} workflows -> {train_out}; {len(test.workflows())} workflows -> {test_out}",
        markup=False)


@trace_app.command("flatten")
def trace_flatten_cmd(file: TraceFileArg, output: OutputOpt):
    """Make every call its own workflow: the same prompts with no workflow structure."""
    from pbkv.trace import read_trace, write_trace
    from pbkv.trace.transform import flatten

    check_outputs([file], {"-o": output})

    with exit_on_error():
        trace = flatten(read_trace(file))
        write_trace(trace, output)
    status_console(output).print(f"wrote {len(trace.calls)} one-call workflows to {output}", markup=False)


@trace_app.command("repair")
def trace_repair_cmd(file: TraceFileArg, output: OutputOpt):
    """Keep the whole runs of a trace whose writer was killed mid-write (`serve --record`)."""
    from pbkv.files import replaced_on_success
    from pbkv.trace.io import open_trace
    from pbkv.trace.repair import kept_trace, repair

    check_outputs([file], {"-o": output})

    with exit_on_error():
        fixed = repair(file)
        trace = kept_trace(fixed)        # what is kept must be a valid trace: checked before writing
        with replaced_on_success(output) as tmp:
            with open_trace(tmp, "w") as f:  # gzip when OUTPUT ends in .gz, like every trace written
                f.write(fixed.text)
    kept = f"kept {len(trace.calls)} calls of {len(trace.workflows())} workflows in {output}"
    status_console(output).print(f"{file}: {repair_summary(fixed)}; {kept}", markup=False)


def repair_summary(fixed) -> str:
    """What `repair` found and dropped, for its status line (without the kept figures)."""
    if fixed.cut_line is None:
        return "not cut (its last line is whole): copied unchanged"
    if fixed.at_line_end:
        found = (f"its last run stops at line {fixed.cut_line} without 'done' (a write stopped at a "
                 f"line's end)")
        cut = ""
    else:
        found, cut = f"ends inside line {fixed.cut_line}", " and the cut line"
    if not fixed.dropped_calls:          # the cut line alone: every whole line's run has its 'done'
        return f"{found}; dropped the cut line (every run before it has its 'done': true)"
    lines = f"{fixed.dropped_calls} whole call line{'s' * (fixed.dropped_calls != 1)}"
    if not fixed.any_done:
        return (f"{found}; no call line has 'done': true, so no run is known to be whole: dropped every "
                f"call ({lines} of {_runs(fixed.dropped_runs)}){cut}")
    return (f"{found}; dropped every run without a 'done': true call ({lines} of "
            f"{_runs(fixed.dropped_runs)}){cut}")


def _runs(n: int) -> str:
    return f"{n} run{'s' * (n != 1)}"


@trace_app.command("import")
def trace_import_cmd(
    source: Annotated[Path, typer.Argument(help="Trace in a foreign format (.jsonl or .jsonl.gz).")],
    fmt: Annotated[str, typer.Option("--from", help="mooncake, bailian or agentic-mooncake.")],
    output: OutputOpt,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Read only the first N rows.")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        min=1, help="Tokens per block id in the output (default: the source's).")] = None,
    source_block_size: Annotated[Optional[int], typer.Option(
        min=1, help="Tokens per id in FILE (default: mooncake 512, bailian 16; required for agentic-mooncake).")] = None,
):
    """Convert a Mooncake, Qwen-Bailian or Dynamo agentic-mooncake trace to pbkv's format."""
    from pbkv.trace.formats import OptionError, import_file

    check_outputs([source], {"-o": output})

    with exit_on_error():
        try:
            trace, report = import_file(fmt, source, output, limit=limit, block_size=block_size,
                                        source_block_size=source_block_size)
        except OptionError as e:  # an unknown --from, a missing --source-block-size: the command line's fault
            fail(str(e))
    status_console(output).print(report.summary(len(trace.workflows()), len(trace.calls)) + f" -> {output}",
                                 markup=False)
    print_notes(report.notes, status_console(output))


@trace_app.command("export")
def trace_export_cmd(
    file: TraceFileArg,
    fmt: Annotated[str, typer.Option("--to", help="agentic-mooncake.")],
    output: output_opt("the exported file (.jsonl; .jsonl.gz compresses)"),
):
    """Write a pbkv trace in a format other replay tools read (Dynamo's agentic-mooncake)."""
    from pbkv.trace.formats import OptionError, export_file

    check_outputs([file], {"-o": output})

    with exit_on_error():
        try:
            report = export_file(fmt, file, output)
        except OptionError as e:  # an unknown --to: the command line's fault
            fail(str(e))
    status_console(output).print(report.summary(output), markup=False)
    print_notes(report.notes, status_console(output))


def print_notes(notes: list[str], out=None) -> None:
    """One `note:` line each, taken literally: notes quote names from the file (sessions, keys),
    which rich would otherwise read as markup (`[red]`)."""
    for note in notes:
        (out or console).print(f"note: {escape(note)}")
