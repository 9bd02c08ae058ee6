"""`pbkv train` and `pbkv predict-eval`: the workflow predictor, trained and scored."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pbkv.cli.common import (EpochsOpt, HorizonOpt, JsonOpt, PredictorOpt, SeedOpt, TracesOpt, TrainOpt,
                             check_horizon, check_outside, check_outputs, console, err_console, exit_on_error, fail, predictor_folder, save_json,
                             written_path)

SPLIT_ADVICE = "try another --seed"   # --split is 50/50: predict-eval has no --test-fraction
# (variant, row label, JSON key prefix) of the predictors predict-eval trains side by side
VARIANT_ROWS = (("fused", "fused", ""), ("history", "history-only", "history_"), ("context", "context-only", "context_"))


def train(
    trace: TracesOpt,
    output: Annotated[Path, typer.Option("-o", "--output", callback=predictor_folder, parser=written_path, help=(
        "Where to write the predictor folder (for --predictor DIR): new, empty, or a saved predictor "
        "(saved as its next version)."))],
    horizon: HorizonOpt = 3,
    variant: Annotated[str, typer.Option(help="fused | history | context.")] = "fused",
    epochs: EpochsOpt = None,
    seed: SeedOpt = 0,
):
    """Train a workflow predictor (next K agents + survival) on traces and save it as a directory."""
    from pbkv.predict import train_predictor
    from pbkv.predict.model import VARIANTS
    from pbkv.trace import read_trace

    check_horizon(horizon)
    if variant not in VARIANTS:
        fail(f"--variant: unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    with exit_on_error():
        traces = [read_trace(t) for t in trace]
        with _train_bar() as bar:
            task = bar.add_task(f"training {variant}", total=None)
            p = train_predictor(traces, variant=variant, horizon=horizon, epochs=epochs, seed=seed,
                                progress=lambda done, total: bar.update(task, completed=done, total=total))
        carried = _save_keeping_history(p, output)
    info = p.info
    top1 = info.get("train_top1_k1")
    console.print(f"{info['parameters']:,} parameters, {len(p.agents)} agents, {info['samples']} samples, "
                  f"{info['epochs']} epochs, trained in {info['train_seconds']:.1f} s; train-set top-1 (k=1) "
                  f"{'n/a' if top1 is None else f'{top1:.3f}'}")
    if carried:
        console.print(f"kept the {carried:,} workflows servers learned from ({output}'s workflows.json) with the "
                      f"new version: the next pbkv serve --predictor {output} starts its window with them",
                      markup=False)  # a path is text, not rich markup
    console.print(f"saved: {output}", markup=False)


def _save_keeping_history(p, output: Path) -> int:
    """Save `p` as the next version of `output`; return how many workflows it carries over.
    A folder a server saved into holds the workflows it learned from (`predict.history`): a
    retrained model replaces the live one, but that history is the users' traffic and would be
    gone two saves later, so the new version keeps it (read under the save lock). An unreadable
    history is not carried, and said so."""
    from pbkv.predict import save_predictor
    from pbkv.predict.history import read_history
    from pbkv.predict.store import has_predictor
    if not has_predictor(output):
        save_predictor(p, output)
        return 0
    try:
        read_history(output)
    except (OSError, ValueError) as e:
        err_console.print(f"[yellow]warning:[/yellow] the workflows saved in {escape(str(output))} are not "
                          f"carried over to the new version: {escape(str(e))}", soft_wrap=True)
        save_predictor(p, output)
        return 0
    save_predictor(p, output, history=[], window=sys.maxsize)   # merges in the live version's, all of them
    return len(read_history(output))


def predict_eval(
    predictor: PredictorOpt = None,
    trace: TracesOpt = None,
    train: TrainOpt = None,
    test: Annotated[Optional[Path], typer.Option(help="With --train: evaluate on this trace.")] = None,
    split: Annotated[bool, typer.Option(help="Split --trace by task (50/50): train on one half, test on the other.")] = False,
    horizon: HorizonOpt = None,
    epochs: EpochsOpt = None,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
):
    """Top-1 accuracy at k=1..K, end-of-workflow accuracy, ECE and speed of predictors, next to Markov.

    --predictor DIR --trace FILE: a saved predictor (and its stored Markov baseline);
    --train FILE... --test FILE or --trace FILE --split: fused, history-only, context-only and Markov,
    trained here."""
    check_horizon(horizon)
    if trace is not None and len(trace) > 1:
        fail("--trace: predict-eval evaluates on one trace")
    one = trace[0] if trace else None
    check_outputs([one, test, *(train or [])], {"--json": json_path})
    check_outside({"--predictor": predictor}, {"--json": json_path})
    with exit_on_error():
        if predictor is not None:
            if one is None or train is not None or test is not None:
                fail("with --predictor give --trace FILE (and optionally --split to score its test half)")
            for option, value in (("--horizon", horizon), ("--epochs", epochs)):
                if value is not None:   # not silently ignored: they shape a predictor trained here
                    fail(f"{option}: a saved --predictor is scored as it was trained; {option} is for "
                         f"predictors trained here (--train or --split)")
            rows, note = _saved_rows(predictor, one, split, seed)
        else:
            rows, note = _trained_rows(one, train, test, split, horizon or 3, epochs, seed)
    _print_predict_table(rows)
    if note:
        console.print(f"note: {escape(note)}")
    if json_path:
        out = {prefix + k: v for _, prefix, m in rows for k, v in m.items()}
        save_json(json_path, out)
        console.print(f"results: {json_path}", markup=False)


def _saved_rows(predictor: Path, trace: Path, split: bool, seed: int) -> tuple[list[tuple[str, str, dict]], str | None]:
    """(label, JSON key prefix, metrics) of a saved predictor and its Markov baseline; and the
    `unseen_note` of the scored data."""
    from pbkv.predict import evaluate, load_predictor, split_by_task
    from pbkv.predict.evaluate import unseen_note
    from pbkv.trace import read_trace
    from pbkv.trace.transform import require_both_parts
    p = load_predictor(predictor)
    data = read_trace(trace)
    if split:
        halves = split_by_task(data, 0.5, seed)
        require_both_parts(*halves, str(trace), SPLIT_ADVICE)
        data = halves[1]
    _require_calls(data, trace)
    rows = [(p.name, "", evaluate(p, data))]
    if p.markov is not None:
        rows.append(("markov", "markov_", evaluate(p.markov, data)))
    return rows, unseen_note(set(p.agents), data)


def _trained_rows(trace, train, test, split, horizon, epochs, seed) -> tuple[list[tuple[str, str, dict]], str | None]:
    """Train the three variants and Markov here; their metrics on the test data, and its `unseen_note`."""
    from pbkv.predict import evaluate, fit_markov, split_by_task, train_predictor
    from pbkv.predict.evaluate import unseen_note
    from pbkv.trace import read_trace
    from pbkv.trace.transform import require_both_parts
    if train is not None and test is not None and trace is None:
        fit, data = [read_trace(t) for t in train], read_trace(test)
    elif trace is not None and split and train is None and test is None:
        fit, data = split_by_task(read_trace(trace), 0.5, seed)
        require_both_parts(fit, data, str(trace), SPLIT_ADVICE)
    else:
        fail("give --predictor DIR --trace FILE, or --train FILE --test FILE, or --trace FILE --split")
    _require_calls(data, test or trace)  # before minutes of training, not a table of dashes after
    rows = []
    with _train_bar() as bar:
        for variant, label, prefix in VARIANT_ROWS:
            task = bar.add_task(f"training {variant}", total=None)
            p = train_predictor(fit, variant=variant, horizon=horizon, epochs=epochs, seed=seed,
                                progress=lambda d, t, task=task: bar.update(task, completed=d, total=t))
            m = evaluate(p, data)
            m["train_seconds"], m["parameters"] = p.info["train_seconds"], p.info["parameters"]
            rows.append((label, prefix, m))
    rows.append(("markov", "markov_", evaluate(fit_markov(fit, horizon), data)))
    fits = fit if isinstance(fit, list) else [fit]   # --train: a list; --split: one half
    return rows, unseen_note({c.agent for t in fits for c in t.calls}, data)


def _require_calls(data, path) -> None:
    if not data.calls:
        raise ValueError(f"{path}: no calls to evaluate on")


def _train_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


# The table shows top-1 at k = 1..TABLE_KS and at the horizon K; --json has every k.
TABLE_KS = 5


def table_ks(horizon: int) -> list[int]:
    """The k columns of the table: 1..min(K, TABLE_KS), then K. Invariant: at most TABLE_KS + 1
    columns, so every figure fits a 110-column console at any horizon (1..1024)."""
    return list(range(1, min(horizon, TABLE_KS) + 1)) + ([horizon] if horizon > TABLE_KS else [])


def _print_predict_table(rows) -> None:
    from rich.table import Table

    from pbkv.bench.report import print_whole

    horizon = max(int(key[6:]) for _, _, m in rows for key in m if key.startswith("top1_k"))
    ks = table_ks(horizon)
    caption = None if ks == list(range(1, horizon + 1)) else \
        f"top-1 at k = 1..{TABLE_KS} and {horizon}; --json FILE has every k"
    table = Table(title=f"next-agent prediction ({rows[0][2]['calls']} positions)", caption=caption)
    for col in ["predictor"] + [f"top1@k{i}" for i in ks] + ["end acc", "ECE", "us/call"]:
        table.add_column(col, justify="left" if col == "predictor" else "right", no_wrap=True)

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)
    for label, _, m in rows:
        table.add_row(label, *[f(m.get(f"top1_k{i}")) for i in ks], f(m["end_acc"]), f(m["ece"]),
                      f(m["us_per_call"], "{:.0f}"))
    print_whole(console, table)
