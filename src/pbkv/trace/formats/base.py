"""What every foreign-format importer shares: reading rows with FILE:LINE errors, field checks, the report.

A foreign row is checked with the native reader's `RowChecker`, so a bad line fails with the same
`TraceError` text the native reader gives: `FILE:LINE: field 'F': what was expected, got VALUE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pbkv.trace.io import TraceError, RowChecker, is_int, is_number, show_value
from pbkv.trace.lines import display_name, read_lines


@dataclass(slots=True)
class Row:
    """One non-blank line of a foreign trace: its JSON object and a checker whose errors say FILE:LINE."""

    line: int
    obj: dict
    chk: RowChecker

    @property
    def where(self) -> str:
        return self.chk.where


def read_rows(path: str | Path, limit: int | None = None) -> tuple[list[Row], bool]:
    """(the first `limit` rows (all when None) of a `.jsonl` or `.jsonl.gz` file, each a JSON object;
    whether the file goes on past them). Read by the native reader's `read_lines`: every way a file
    can be unreadable (not UTF-8, bad gzip, JSON too deep...) is a `TraceError` naming FILE:LINE, as
    for a pbkv trace. Lines past the limit are not checked: only whether one exists is looked at."""
    rows: list[Row] = []
    if limit is not None and limit < 1:
        return rows, False
    name = display_name(Path(path))
    lines = read_lines(path, name, pbkv=False)
    try:
        for lineno, _, obj in lines:
            where = f"{name}:{lineno}"
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {show_value(obj)}")
            rows.append(Row(lineno, obj, RowChecker(where, obj)))
            if len(rows) == limit:  # stop before reading on: lines past the limit are not checked
                return rows, _goes_on(lines)
        return rows, False
    finally:
        lines.close()


def _goes_on(lines) -> bool:
    """Whether `read_lines` has another non-blank line. One that cannot be read or parsed still
    counts: it is past the limit, so it is not an error, but the file does go on."""
    try:
        next(lines)
    except StopIteration:
        return False
    except TraceError:
        return True
    return True


def session_done(is_last: bool, report: ImportReport) -> bool | None:
    """`done` of a session's row: False before its last kept row; on that row True, or None
    (unknown, as for a run that may continue) when `--limit` stopped before the end of the file,
    since any session may go on past the cut (knowing which would mean reading the whole file)."""
    if not is_last:
        return False
    return None if report.cut else True


def number(chk: RowChecker, name: str, required: bool = False) -> float | None:
    """A finite number >= 0 (None when absent and not required)."""
    if name not in chk.obj and not required:
        return None
    v = chk.required(name)
    if not is_number(v) or v < 0:
        chk.fail(name, "expected a finite number >= 0")
    return float(v)


def lengths_and_ids(chk: RowChecker, block_size: int) -> tuple[int, int, list[int]]:
    """(input_length, output_length, hash_ids), with `ceil(input_length / block_size)` ids."""
    input_length = chk.length_field("input_length", 1)
    output_length = chk.length_field("output_length", 0)
    ids = chk.required("hash_ids")
    if not isinstance(ids, list) or not all(is_int(h) for h in ids):
        chk.fail("hash_ids", "expected a list of integers")
    want = -(-input_length // block_size)
    if len(ids) != want:
        chk.fail("hash_ids", f"expected {want} ids for input_length {input_length} and source block size "
                             f"{block_size}, found {len(ids)}")
    return input_length, output_length, ids


def str_list(chk: RowChecker, name: str) -> list[str]:
    """An optional list of non-empty strings (empty when absent)."""
    v = chk.obj.get(name, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        chk.fail(name, "expected a list of non-empty strings")
    return v


@dataclass(slots=True, frozen=True)
class Edge:
    """A dependency `src -> dst` between two rows of a foreign trace (row ids as that format names them)."""

    src: str
    dst: str
    kind: str  # spawn / join: across sessions; skip: same session, not consecutive; dangling: unknown src
    wait_ms: float = 0.0


@dataclass(slots=True)
class ImportReport:
    """What an import kept, changed and could not express. `notes` are one line each."""

    fmt: str
    source: str
    rows: int = 0
    source_block_size: int = 0
    block_size: int = 0
    limited: bool = False  # --limit cut the file: links to rows past the cut are reported, not errors
    cut: bool = False      # the file goes on past the --limit rows: sessions may continue past the cut
    notes: list[str] = field(default_factory=list)
    dropped_edges: list[Edge] = field(default_factory=list)

    def edge_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.dropped_edges:
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    def edge_note(self, shown: int = 5) -> str | None:
        """One line naming the first `shown` dropped edges (all are in `dropped_edges`)."""
        if not self.dropped_edges:
            return None
        items = [f"{e.src} -> {e.dst} ({e.kind}" + (f", waits {e.wait_ms:g} ms)" if e.wait_ms else ")")
                 for e in self.dropped_edges[:shown]]
        more = len(self.dropped_edges) - shown
        return "edges not kept: " + ", ".join(items) + (f" and {more} more" if more > 0 else "")

    def summary(self, workflows: int, calls: int) -> str:
        text = (f"imported {calls} calls of {workflows} workflows from {self.rows} {self.fmt} rows "
                f"(block size {self.source_block_size} -> {self.block_size})")
        if self.dropped_edges:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.edge_counts().items()))
            n = len(self.dropped_edges)
            text += f"; {n} DAG edge{'s' if n != 1 else ''} not expressible as workflow steps ({kinds})"
        return text


@dataclass(slots=True)
class ExportReport:
    fmt: str
    rows: int = 0
    workflows: int = 0
    block_size: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self, path) -> str:
        return (f"wrote {self.rows} {self.fmt} rows of {self.workflows} workflows to {path} "
                f"(trace block size {self.block_size}: replay with that block size)")
