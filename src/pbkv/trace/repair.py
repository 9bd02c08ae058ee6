"""Repair a trace whose writer was killed mid-write: keep its whole runs, drop the unfinished ones.

`pbkv serve --record` writes each ended workflow run, one run after another, in one `write` call
(`serve/recorder.py`); a kill -9 can still stop that write between pages, so the file being
written ends inside a line, after some of that run's lines, with no `done`. `read_trace` refuses
such a file (the cut line is not JSON). `repair` drops the cut line and every run none of whose
calls has `done: true` (an unfinished run: the cut line's run among them), and keeps every whole
run, saying what it dropped. A file whose last line is whole needs no repair and is kept as it is.

A run is whole only when one of its lines says so (`done: true`): which run the cut line belongs
to cannot be read from it, so a run without `done` may be the cut one. Runs are matched by
`workflow_id`, not by position, so a trace whose workflows interleave ("Calls of different
workflows may be interleaved in any order", docs/trace-format.md) keeps its whole runs too, and
no part of an unfinished run is ever kept. A file with no `done: true` at all keeps no call: no
run in it is known to be whole.

A write can also stop exactly at a line's end: every line is whole and the file reads, but its
last run has no `done`. In a file `pbkv serve` recorded (its metadata's `source`), where every
run ends with `done: true`, the unfinished runs are dropped the same way (`at_line_end`).

Lines that are not calls (the metadata, blank lines, lines `read_trace` refuses) are kept where
they are, so `kept_trace` reports what repair cannot fix at the file's own line numbers.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pbkv.trace.call import Trace
from pbkv.trace.io import read_trace
from pbkv.trace.lines import TraceError, display_name

BAD = object()                             # what `_json` gives for a line that is not JSON


@dataclass
class Repair:
    data: bytes                 # the repaired file's bytes: the kept lines
    cut_line: int | None        # the line the file ended inside, or its last call line (None: not cut)
    dropped_calls: int          # whole call lines of unfinished runs, dropped with them
    at_line_end: bool = False   # cut at a line's end: the last line is whole, its run unfinished
    name: str = ""              # the file's name, for errors
    dropped_runs: int = 0       # unfinished runs with whole lines in the file (the cut line's excluded)
    any_done: bool = True       # some call line has `done: true` (else no run is known to be whole)
    checked: bytes = b""        # the file's lines, dropped ones emptied: each kept line at its own number

    @property
    def text(self) -> str:
        """`data` as text; `TraceError` naming the file and line of the first byte that is not UTF-8."""
        try:
            self.checked.decode("utf-8")   # the file's line numbers (`data` lacks the dropped lines)
        except UnicodeDecodeError as e:
            line = self.checked.count(b"\n", 0, e.start) + 1
            col = e.start - (self.checked.rfind(b"\n", 0, e.start) + 1) + 1
            raise TraceError(f"{self.name}:{line}: not UTF-8 text (byte 0x{self.checked[e.start]:02x} at "
                             f"column {col})") from None
        return self.data.decode("utf-8")


def repair(path: str | Path) -> Repair:
    """The whole runs of the trace file at `path` (see the module docstring); `TraceError` for a
    file that cannot be read or is compressed (a cut .gz stream is not recoverable line by line)."""
    path = Path(path)
    name = display_name(path)
    if path.suffix == ".gz":
        raise TraceError(f"{name}: repair reads plain .jsonl files only (decompress it first)")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{name}: cannot read ({e.strerror or e})") from None
    lines = raw.split(b"\n")
    tail = lines.pop()                     # after the last newline: b"" unless the file is cut
    at_line_end = not tail.strip() or _json(tail) is not BAD
    if tail.strip() and at_line_end:
        lines.append(tail)                 # a last line without its newline, but whole
    objs = [_json(line) if line.strip() else None for line in lines]   # each line parsed once
    present = [o for o, line in zip(objs, lines) if line.strip()]
    if at_line_end and not (_recorded(present) and not _ends_a_run(present)):
        return Repair(raw, None, 0, name=name, checked=raw)
    whole = {_run(o) for o in objs if _is_call(o) and o.get("done") is True}
    drop = [_is_call(o) and _run(o) not in whole for o in objs]
    kept = [b"" if d else line for d, line in zip(drop, lines)]
    return Repair(data=b"".join(line + b"\n" for line, d in zip(lines, drop) if not d),
                  cut_line=_last_line(lines) if at_line_end else len(lines) + 1,
                  dropped_calls=sum(drop), at_line_end=at_line_end, name=name,
                  dropped_runs=len({_run(o) for o, d in zip(objs, drop) if d}), any_done=bool(whole),
                  checked=b"".join(line + b"\n" for line in kept))


def kept_trace(fixed: Repair) -> Trace:
    """The kept lines read as a trace (`read_trace`'s checks: what repair cannot fix is an error).
    It reads `fixed.checked`, so its errors name the repaired file at the file's own line numbers."""
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder) / "kept.jsonl"
        tmp.write_bytes(fixed.checked)
        try:
            return read_trace(tmp)
        except TraceError as e:
            raise TraceError(str(e).replace(display_name(tmp), fixed.name, 1)) from None


def _is_call(obj) -> bool:
    return isinstance(obj, dict) and "pbkv_trace" not in obj


def _run(obj: dict):
    """The run a call line belongs to: its `workflow_id` (as JSON text: any value is hashable)."""
    return json.dumps(obj.get("workflow_id"), sort_keys=True)


def _last_line(lines: list[bytes]) -> int:
    """The number of the last line that is not blank (trailing blank lines are no call's)."""
    return max((i + 1 for i, line in enumerate(lines) if line.strip()), default=0)


def _recorded(objs: list) -> bool:
    """The file's first line is the metadata `pbkv serve --record` writes."""
    first = objs[0] if objs else None
    return (isinstance(first, dict) and "pbkv_trace" in first
            and str(first.get("source", "")).startswith("pbkv serve"))


def _ends_a_run(objs: list) -> bool:
    """The last line is the metadata alone or a call with `done: true`."""
    last = objs[-1] if objs else None
    return isinstance(last, dict) and ("pbkv_trace" in last or last.get("done") is True)


def _json(line: bytes):
    try:
        return json.loads(line)
    except ValueError:                     # includes UnicodeDecodeError
        return BAD
