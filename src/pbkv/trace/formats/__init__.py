"""Foreign trace formats: import them into TRACE_FORMAT v1, export pbkv traces to them.

Each format is one module (`mooncake`, `bailian`, `agentic`) behind the `FORMATS` registry; a
module reads checked rows into `Call`s carrying the source's raw block ids, and this package
re-chains those ids at the wanted block size (`blocks.Rechainer`), builds the `Trace` and checks
it with the native rules (`validate`). A bad row fails with `TraceError` naming FILE:LINE, field
and value, as the native reader does.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, Callable

from pbkv.files import replaced_on_success
from pbkv.trace.call import Call, Trace, TraceMeta
from pbkv.trace.formats import agentic, bailian, mooncake
from pbkv.trace.formats.base import Edge, ExportReport, ImportReport, Row, read_rows
from pbkv.trace.formats.blocks import Rechainer
from pbkv.trace.io import TraceError, open_trace, read_trace, validate, write_trace
from pbkv.trace.lines import display_name, read_lines

__all__ = ["FORMATS", "Edge", "ExportReport", "Format", "ImportReport", "OptionError", "Rechainer",
           "export_file", "import_file", "import_trace"]


class OptionError(TraceError):
    """A refused option value (an unknown format, a missing source block size), not bad data:
    `pbkv trace import|export` exits 2 for it, as for any bad command line. A `TraceError` still,
    so callers that catch those keep working."""


@dataclass(frozen=True, slots=True)
class Format:
    """A foreign format: its default block size (None: the files do not record it), its reader
    and/or writer, and `check`, which refuses (before anything is written) a trace the writer
    cannot write faithfully, naming the call by `where(index in trace.calls)`."""

    name: str
    block_size: int | None
    read: Callable[[list[Row], int, ImportReport], list[Call]] | None = None
    write: Callable[[Trace, IO[str]], ExportReport] | None = None
    check: Callable[[Trace, Callable[[int], str]], None] | None = None


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("mooncake", mooncake.BLOCK_SIZE, read=mooncake.read),
    Format("bailian", bailian.BLOCK_SIZE, read=bailian.read),
    Format("agentic-mooncake", agentic.BLOCK_SIZE, read=agentic.read, write=agentic.write, check=agentic.check),
)}


def _format(name: str, role: str) -> Format:
    """The format called `name` that can `role` ('read' or 'write')."""
    fmt = FORMATS.get(name)
    if fmt is None or getattr(fmt, role) is None:
        known = ", ".join(n for n, f in FORMATS.items() if getattr(f, role) is not None)
        raise OptionError(f"cannot {role} format {name!r} (formats that can: {known})")
    return fmt


def import_trace(name: str, path: str | Path, *, limit: int | None = None, block_size: int | None = None,
                 source_block_size: int | None = None) -> tuple[Trace, ImportReport]:
    """Read a foreign trace into a validated `Trace` at `block_size` tokens per id (default: the
    source's). `limit` keeps the first N rows; `source_block_size` overrides the format's default.
    Options are checked (`OptionError`) before the file is opened."""
    fmt = _format(name, "read")
    source = source_block_size or fmt.block_size
    if source is None:
        raise OptionError(f"{path}: {name} files do not record their block size: give the source block size "
                          f"(--source-block-size: the value the tool that wrote the file printed)")
    target = block_size or source
    if limit is not None and limit < 1:
        raise OptionError(f"limit must be >= 1, got {limit}")
    report = ImportReport(name, str(path), source_block_size=source, block_size=target,
                          limited=limit is not None)
    rows, report.cut = read_rows(path, limit)
    if not rows:  # an empty output trace would only fail later, in bench or train, far from its cause
        raise TraceError(f"{path}: no {name} rows to import (the file is empty or holds only blank lines)")
    report.rows = len(rows)
    calls = fmt.read(rows, source, report)
    chain = Rechainer(source, target)
    for call in calls:
        call.hash_ids = chain.convert(call.hash_ids, call.input_length)
    meta = TraceMeta(block_size=target, source=f"pbkv trace import --from {name} {Path(path).name}",
                     notes=f"{len(rows)} {name} rows; source block size {source}, re-chained at {target}")
    if report.dropped_edges:  # the trace itself says what structure it lost
        meta.extra["dropped_edges"] = report.edge_counts()
        report.notes.append(report.edge_note())
    _note_cut_sessions(calls, report)
    trace = Trace(meta, calls, path=str(path))
    validate(trace, str(path))
    return trace, report


def _note_cut_sessions(calls: list[Call], report: ImportReport) -> None:
    """One note when --limit left sessions without `done` (`base.session_done`)."""
    cut = len({c.workflow_id for c in calls if c.done is None})
    if cut:
        report.notes.append(f"the file goes on past the first {report.rows} row(s) (--limit): {cut} session(s) "
                            f"may continue past the cut, so their last kept rows get no `done`")


def import_file(name: str, src: str | Path, dst: str | Path, **options) -> tuple[Trace, ImportReport]:
    """`import_trace` then write the result (gzip when `dst` ends in `.gz`)."""
    trace, report = import_trace(name, src, **options)
    write_trace(trace, dst)
    return trace, report


def export_file(name: str, src: str | Path, dst: str | Path) -> ExportReport:
    """Read a pbkv trace and write it in format `name` (gzip when `dst` ends in `.gz`). Every check
    runs before `dst` is opened: a refused trace writes nothing."""
    fmt = _format(name, "write")
    trace = read_trace(src)
    if not trace.calls:   # an empty file, which `import_file` would refuse to read back
        raise TraceError(f"{display_name(Path(src))}: no calls to export")
    if fmt.check is not None:
        fmt.check(trace, lambda index: _call_where(src, index))
    with replaced_on_success(dst) as tmp, open_trace(tmp, "w") as f:
        return fmt.write(trace, f)


def _call_where(path: str | Path, index: int) -> str:
    """'FILE:LINE' of call `index` (from 0) of a pbkv trace that `read_trace` accepted. The file is
    read again (only to report an error): a `Trace` does not keep line numbers, and in a valid
    trace every line with `pbkv_trace` comes before the calls, so call lines are the others."""
    name = display_name(Path(path))
    calls = (lineno for lineno, _, obj in read_lines(path, name) if "pbkv_trace" not in obj)
    line = next(islice(calls, index, None), None)  # None: the file changed since it was read
    return f"{name}:{line}" if line is not None else f"{name}: call {index + 1}"
