"""Repair a trace whose writer was killed mid-write: keep its whole runs, drop the cut one.

`pbkv serve --record` writes each ended workflow run, one run after another, in one `write` call
(`serve/recorder.py`); a kill -9 can still stop that write between pages, so the file being
written ends inside a line, after some of that run's lines, with no `done`. `read_trace` refuses
such a file (the cut line is not JSON). `repair` keeps every line up to the last call line with
`done: true` before the cut (the last whole run) and drops the rest, saying what it dropped. A
file whose last line is whole needs no repair and is kept as it is.

Made for files written run after run (`--record`): in a trace whose workflows interleave, the
calls of other workflows after the last `done` would be dropped too (their runs are unfinished
in the file anyway). Not caught: a write stopped exactly at a line's end (every line whole); the
file then reads, its last run without `done` (shorter than it was).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pbkv.trace.lines import TraceError, display_name


@dataclass
class Repair:
    data: bytes                 # the repaired file's bytes
    cut_line: int | None        # the line the file ended inside (None: not cut)
    dropped_calls: int          # whole call lines of the cut run, dropped with it


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
    if not tail.strip() or _is_json(tail):
        return Repair(raw, None, 0)
    keep = 0                               # lines kept: up to the last whole run's end
    for i, line in enumerate(lines):
        obj = _json(line)
        if isinstance(obj, dict) and ("pbkv_trace" in obj and not keep or obj.get("done") is True):
            keep = i + 1
    dropped = sum(1 for line in lines[keep:] if isinstance(_json(line), dict))
    kept = b"".join(line + b"\n" for line in lines[:keep])
    return Repair(kept, len(lines) + 1, dropped)


def _json(line: bytes):
    try:
        return json.loads(line)
    except ValueError:                     # includes UnicodeDecodeError
        return None


def _is_json(line: bytes) -> bool:
    return _json(line) is not None or line.strip() == b"null"
