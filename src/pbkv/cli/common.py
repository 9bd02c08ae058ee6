"""What every command shares: the console, the option declarations, errors -> `error: ...`, exit 2.

Each option that more than one command takes is declared once here, as an `Annotated` alias;
a command gives only its default (`workflows: WorkflowsOpt = 400`). The help text therefore
says where the default differs between commands.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from pbkv import files
from pbkv.trace import TraceError

# Tables need ~110 columns; a narrower (or piped) output still gets them whole.
console = Console(width=max(110, shutil.get_terminal_size((110, 24)).columns))

err_console = Console(width=console.width, stderr=True)


def writes_stdout(path: Path | None) -> bool:
    """Whether writing `path` writes this process's standard output (`-o /dev/stdout`)."""
    if path is None:
        return False
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return str(path) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def status_console(*outputs: Path | None) -> Console:
    """Where a command's status lines go: stderr when one of its outputs is stdout, so that a
    piped trace (`pbkv gen hover -o /dev/stdout | pbkv trace stats /dev/stdin`) holds nothing else;
    else `console`."""
    return err_console if any(writes_stdout(p) for p in outputs) else console


MODEL_HELP = ("Language model: 'tiny' (random small Llama, byte tokenizer), 'smollm2' (needs pbkv\\[smollm2]) "
              "or a local model directory. bench: used with --engine hf or vllm.")

# ---- inputs
WorkloadOpt = Annotated[str, typer.Option(
    help="Built-in workload name or spec file (.yaml/.json); bench and ablate take several, comma-separated "
         "(default: bench hover,swe,finance,dialogue; ablate hover,swe,finance; not with --trace); simcheck also a "
         "trace file.")]
TracesOpt = Annotated[Optional[list[Path]], typer.Option(
    "--trace", help="Trace file (repeatable): bench and ablate replay these instead of generating; train trains "
                    "on them; predict-eval evaluates on one.")]
TrainOpt = Annotated[Optional[list[Path]], typer.Option(
    "--train", help="Train the predictor(s) on these traces (repeatable). Policies that predict (pbkv*) need a "
                    "predictor: trained on --train, loaded from --predictor, or (generated workloads) trained on "
                    "the generator with seed + 1.")]
WorkflowsOpt = Annotated[int, typer.Option(min=1, help=(
    "Workflows per generated workload (gen: 100, bench and ablate: 400, simcheck: 8, perf sim: 2000, perf "
    "policy: 600; not with a trace, which is replayed whole)."))]
# 0 .. 2**63-1: torch.manual_seed takes at most 2**64-1, and a derived seed (bench trains on seed + 1) stays in range
SEED_MAX = 2 ** 63 - 1
SeedOpt = Annotated[int, typer.Option(min=0, max=SEED_MAX, help=(
    "Random seed, 0 to 2**63-1: generated workloads, training, splits, sampling."))]
TraceFileArg = Annotated[Path, typer.Argument(help="Trace file.")]


def written_path(value) -> Path:
    """A path the command writes to (`parser=` of its option): an empty value (`--out "$UNSET"`)
    is refused, where a plain `Path` option reads it as `.` and writes into the current folder."""
    if isinstance(value, Path):
        return value
    if not str(value).strip():
        raise typer.BadParameter("is empty: give a path (an unset shell variable?)")
    return Path(value)


def output_file(path: Path | None) -> Path | None:
    """An output file's path, checked when the command line is read (`files.check_output_file`)."""
    return _checked(files.check_output_file, path)


def output_folder(path: Path | None) -> Path | None:
    """An output folder's path, checked like `output_file`'s (`files.check_output_folder`)."""
    return _checked(files.check_output_folder, path)


def readable_folder(path: Path | None) -> Path | None:
    """A folder a command reads and may write but can use read-only (`serve --shared-dir`):
    checked like `output_folder`'s, except that it need not be writable."""
    return _checked(files.check_readable_folder, path)


def _checked(check, path: Path | None) -> Path | None:
    if path is not None:
        try:
            check(path)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return path


def predictor_folder(path: Path | None) -> Path | None:
    """A folder a predictor is saved into: checked like `output_folder`'s, and it must be new,
    empty or a saved predictor (a save replaces files there: `predict.store.check_target`)."""
    from pbkv.predict.store import check_target
    output_folder(path)
    if path is not None:
        try:
            check_target(path)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return path


def check_outputs(inputs, outputs: dict[str, Path | None]) -> None:
    """Exit 2 when an output (option name -> path) is the same file as an input or as another
    output: writing it would destroy the input, or one output would overwrite the other."""
    taken: dict[tuple, str] = {}
    for path in inputs:
        if path is not None:
            taken.setdefault(_file_key(path), f"the input {path}")
    for option, path in outputs.items():
        if path is None or (path.exists() and not path.is_file()):   # /dev/null may take every output
            continue
        key = _file_key(path)
        if key in taken:
            fail(f"{option} {path} is {taken[key]}; write to another file")
        taken[key] = f"also {option}"


def check_outside(folders: dict[str, Path | None], outputs: dict[str, Path | None]) -> None:
    """Exit 2 when an output (option name -> path) lies inside a folder that is read (option name
    -> folder, e.g. `--predictor`): writing there would replace or add to a saved predictor while it
    is being scored. Invariant: no command writes under a folder it reads."""
    for folder_option, folder in folders.items():
        if folder is None:
            continue
        root = os.path.realpath(folder)
        for option, path in outputs.items():
            real = os.path.realpath(path) if path is not None else None
            if real is not None and (real == root or real.startswith(root.rstrip(os.sep) + os.sep)):
                fail(f"{option} {path} is inside the {folder_option} {folder}; write to another file")


def _file_key(path) -> tuple:
    """One key per file: (device, inode) when it exists (hard links, symlinks), else its real path."""
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return (os.path.realpath(path),)


def save_json(path: Path, data) -> None:
    """`bench.report.write_json` (folder created, whole or not at all); an error is one `error:` line."""
    from pbkv.bench.report import write_json
    with exit_on_error():
        write_json(data, path)


def output_opt(what: str, folder: bool = False):
    """`-o/--output` whose help says what the command writes there (a file, or with `folder` a folder)."""
    return Annotated[Path, typer.Option("-o", "--output", help=f"Where to write {what}.",
                                        callback=output_folder if folder else output_file, parser=written_path)]


OutputOpt = output_opt("the trace (.jsonl; .jsonl.gz compresses)")
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Also write the figures to this JSON file.",
                                                 callback=output_file, parser=written_path)]
OutOpt = Annotated[Path, typer.Option(help="Folder for the JSON results, plots, profile and trained predictors.",
                                      callback=output_folder, parser=written_path)]

# ---- what runs
PoliciesOpt = Annotated[str, typer.Option(
    help="Policies to compare, comma-separated (bench adds lru, the reference, and oracle, the bound).")]
PolicyOpt = Annotated[str, typer.Option(
    help="Cache policy: lru, kvflow, pbkv (or a variant: pbkv-retired, ...; or package.module:Class).")]
ConcurrencyOpt = Annotated[str, typer.Option(
    help="Concurrent workflows ('open': arrivals by trace t); bench and ablate sweep a comma-separated list.")]
ProfileOpt = Annotated[Optional[str], typer.Option(
    help="Simulator profile: a built-in name or a profile JSON file (simcheck default: calibrate now into "
         "OUT/profile.json).")]
JobsOpt = Annotated[int, typer.Option(min=1, help="Parallel worker processes.")]

# ---- the cache (pbkv.cache.config.CacheConfig; unset: the engine's default)
DeviceTokensOpt = Annotated[Optional[int], typer.Option(
    min=1, help="Device KV capacity in tokens (default: bench each --pressure regime's, or the profile's with "
                "--pressure profile; hf 8 x the longest scaled call; simcheck 0.3 of the scaled workload's "
                "distinct prompt tokens, at least the longest call; serve 16384; vllm 768).")]
HostTokensOpt = Annotated[Optional[int], typer.Option(
    min=0, help="Host KV capacity in tokens (default: sim and hf profile host_ratio x device; simcheck without "
                "--device-tokens 0; serve 2 x device; vllm 512).")]
DiskTokensOpt = Annotated[Optional[int], typer.Option(
    min=0, help="Disk KV capacity in tokens (default: sim the profile's; hf 8 x device; simcheck without "
                "--device-tokens 0; serve 4 x device; vllm 16384).")]

# ---- models
ModelOpt = Annotated[str, typer.Option(help=MODEL_HELP)]
PredictorOpt = Annotated[Optional[Path], typer.Option(
    help="A predictor directory saved by `pbkv train` (serve: loaded at start if present, saved on shutdown).")]
HorizonOpt = Annotated[Optional[int], typer.Option(
    help="Prediction horizon K, steps ahead, 1 to 1,024 (default: the predictor's; 3 when training).")]
EpochsOpt = Annotated[Optional[int], typer.Option(min=1, help="Training epochs (default: about 1,250 steps).")]
OnlineOpt = Annotated[bool, typer.Option(
    help="Retrain the predictor from finished workflows during the run (bench: every 200, at the predictor's "
         "horizon; a retrain on fewer workflows than the predictor it would replace is not used; bench.json "
         "counts them in online_retrains) or while serving (every --learn-every).")]

# ---- the real engine
ScaleOpt = Annotated[float, typer.Option(
    help="Real engines: divide every prompt and output length by this (prefix sharing kept).")]
OutputScaleOpt = Annotated[Optional[float], typer.Option(
    help="Real engines: divide output lengths by this instead (default: --scale).")]
LoadRuleOpt = Annotated[str, typer.Option(
    help="Real engine, host/disk prefixes: auto (load if estimated faster than recompute), load, recompute.")]
ThreadsOpt = Annotated[int, typer.Option(
    min=1, help="torch CPU threads of the real engine (1 is fastest for small models on a shared CPU).")]
RouterOpt = Annotated[Optional[str], typer.Option(
    help="Router placing calls on engine instances (docs/scale-out.md): round-robin, least-load, prefix, sticky, "
         "pbkv, or package.module:Class. bench (--instances > 1): a comma-separated list compared side by side; "
         "serve (--replicas > 1): one. Default: pbkv.")]


def split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def distinct(option: str, values: list) -> list:
    """`values` of a comma-separated option, each once (exit 2 naming the repeated one: it would
    run twice and print its rows twice)."""
    for i, v in enumerate(values):
        if v in values[:i]:
            fail(f"{option}: {v} given twice")
    return values


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` (taken literally, not as rich markup) and exit with `code`:
    2 for a bad command line or setup, 1 for bad input data (a malformed trace).
    On stderr, as one line (never wrapped): `2> err.log` and `grep` find it whole, and a command
    writing a trace to stdout (`-o /dev/stdout | pbkv trace stats /dev/stdin`) never puts it in
    the stream, where the reader would report "not valid JSON" instead."""
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def exit_on_error(debug: bool | None = None):
    """The one place where known errors become a one-line `error: ...`: a malformed trace exits 1
    (TraceError, FILE:LINE in the message); bad values, unreadable files, policies and predictors
    (ValueError, OSError), a model that cannot load, a stuck engine or a failed vLLM worker exit 2.
    Anything else is a bug: it keeps its traceback when `debug` is None (the default) or True;
    with `debug=False` (a command's `--debug` off) it becomes one line, `error: Type: message`,
    and exit 1, so a failed run is not a page of traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except TraceError as e:  # the input file is bad, not the command line: exit 1, FILE:LINE in the message
        fail(str(e), code=1)
    except (ValueError, OSError) as e:  # UnknownPolicy, PredictorLoadError are ValueErrors
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - sorted below: known, or a bug shown short or in full
        from pbkv.bench.vllm_run import VLLMRunError
        from pbkv.engine.hf import EngineError, ModelLoadError  # imported here: it loads torch
        if isinstance(e, (ModelLoadError, EngineError, VLLMRunError)):
            fail(str(e))
        if debug is not False:
            raise
        err_console.print(f"[red]error:[/red] {escape(type(e).__name__)}: {escape(str(e))} "
                          f"(run again with --debug for the traceback)", soft_wrap=True)
        raise typer.Exit(1) from None


DebugOpt = Annotated[bool, typer.Option(help="On a failure, show the full traceback instead of a one-line error.")]


def concurrency_list(value: str) -> list[int | None]:
    """'16,32,open' -> [16, 32, None]."""
    out: list[int | None] = []
    for v in split(value):
        if v == "open":
            out.append(None)
        elif v.isdigit() and int(v) > 0:
            out.append(int(v))
        else:
            fail(f"--concurrency: expected positive integers or 'open', got {v!r}")
        if out[-1] in out[:-1]:
            fail(f"--concurrency: {v} given twice")
    if not out:
        fail(f"--concurrency: expected positive integers or 'open', comma-separated, got {value!r}")
    return out


def one_concurrency(value: str) -> int | None:
    values = concurrency_list(value)
    if len(values) != 1:
        fail(f"--concurrency: expected one value, got {value!r}")
    return values[0]


def check_horizon(horizon: int | None) -> None:
    """Exit 2 naming --horizon unless it is None or 1..MAX_HORIZON (the model's own check would
    name its config.json field, and only after the traces were read)."""
    from pbkv.predict.base import MAX_HORIZON
    if horizon is not None and not 1 <= horizon <= MAX_HORIZON:
        fail(f"--horizon: must be from 1 to {MAX_HORIZON:,}, got {horizon}")


def check_exist(*paths: Path | None) -> None:
    for path in paths:
        if path is not None and not path.exists():
            fail(f"{path}: no such file or directory")


def strs(paths: list[Path] | None) -> tuple[str, ...]:
    return tuple(str(p) for p in paths or [])
