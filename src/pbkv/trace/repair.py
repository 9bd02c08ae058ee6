"""Repair a trace whose writer was killed mid-write: keep its whole runs, drop the cut one.

`pbkv serve --record` writes each ended workflow run, one run after another, in one `write` call
(`serve/recorder.py`); a kill -9 can still stop that write between pages, so the file being
written ends inside a line, after some of that run's lines, with no `done`. `read_trace` refuses
such a file (the cut line is not JSON). `repair` keeps every line up to the last call line with
`done: true` before the cut (the last whole run) and drops the rest, saying what it dropped. A
file whose last line is whole needs no repair and is kept as it is.

A write can also stop exactly at a line's end: every line is whole and the file reads, but its
last run has no `done`. In a file `pbkv serve` recorded (its metadata's `source`), where every
run ends with `done: true`, that run is dropped the same way (`at_line_end`).

Made for files written run after run (`--record`): in a trace whose workflows interleave, the
calls of other workflows after the last `done` would be dropped too (their runs are unfinished
in the file anyway).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pbkv.trace.lines import TraceError, display_name

BAD = object()                             # what `_json` gives for a line that is not JSON


@dataclass
class Repair:
    data: bytes                 # the repaired file's bytes
    cut_line: int | None        # the line the file ended inside, or its last (None: not cut)
    dropped_calls: int          # whole call lines of the cut run, dropped with it
    at_line_end: bool = False   # cut at a line's end: the last line is whole, its run unfinished
    name: str = ""              # the file's name, for errors

    @property
    def text(self) -> str:
        """`data` as text; `TraceError` naming the file and line of the first byte that is not UTF-8."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = self.data.count(b"\n", 0, e.start) + 1
            col = e.start - (self.data.rfind(b"\n", 0, e.start) + 1) + 1
            raise TraceError(f"{self.name}:{line}: not UTF-8 text (byte 0x{self.data[e.start]:02x} at "
                             f"column {col})") from None


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
        return Repair(raw, None, 0, name=name)
    keep = 0                               # lines kept: up to the last whole run's end
    for i, obj in enumerate(objs):
        if isinstance(obj, dict) and ("pbkv_trace" in obj and not keep or obj.get("done") is True):
            keep = i + 1
    dropped = sum(1 for obj in objs[keep:] if isinstance(obj, dict))
    kept = b"".join(line + b"\n" for line in lines[:keep])
    last = len(lines) if at_line_end else len(lines) + 1
    return Repair(kept, last, dropped, at_line_end, name)


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
