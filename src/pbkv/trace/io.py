"""Read, validate and write trace format v1 files (docs/trace-format.md) (`.jsonl` or `.jsonl.gz`).

Every rule of the format is checked; a bad line raises `TraceError` naming the file, the line,
the field and the value. Nothing is skipped silently (blank lines carry no call and are allowed).
"""

from __future__ import annotations

import gzip
import io
import json
import math
from pathlib import Path
from contextlib import contextmanager
from typing import IO, Iterable, Iterator

from pbkv.files import replaced_on_success
from pbkv.trace.call import DEFAULT_BLOCK_SIZE, Call, Trace, TraceMeta
from pbkv.trace.lines import TraceError, display_name, read_lines

CALL_FIELDS = ("workflow_id", "step", "agent", "workload", "t", "tool_wait", "input_length",
               "output_length", "hash_ids", "context", "done")
META_FIELDS = ("block_size", "source", "license", "notes")
# The most tokens an `input_length` or `output_length` may hold: a thousand times the longest
# context any model serves, and exact as a float, so every figure computed from lengths (means,
# percentiles, costs) is a finite number; a JSON integer may otherwise be of any size (10**400).
MAX_LENGTH = 1_000_000_000
# The longest `tool_wait` (seconds, ~32 years): a larger one is a unit slip, and waits add up along
# a workflow into the replay's clock, where 1e308 + 1e308 is inf (NaN latencies in every figure).
MAX_TOOL_WAIT = 1_000_000_000


@contextmanager
def open_trace(path: Path, mode: str) -> Iterator[IO[str]]:
    if path.suffix != ".gz":
        with open(path, mode, encoding="utf-8") as f:
            yield f
        return
    # no file name and mtime=0 in the header: the same trace gives byte-identical .gz files
    with open(path, mode + "b") as raw, gzip.GzipFile(filename="", mode=mode + "b", fileobj=raw, mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8") as f:
        yield f


def show_value(value) -> str:
    """A short, printable (ASCII-safe) rendering of a value for an error message."""
    try:
        text = json.dumps(value) if not isinstance(value, str) else ascii(value)
    except (RecursionError, ValueError):
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float (not a bool) that is finite as a float: a JSON integer too large for a
    float (10**400) is not one (`math.isfinite` raises OverflowError on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class RowChecker:
    """Validates one line's object; `where` is 'FILE:LINE' for messages."""

    def __init__(self, where: str, obj: dict):
        self.where, self.obj = where, obj

    def fail(self, field: str, msg: str):
        """Raise: '{where}: field '{field}': {msg}, got {value}' (or ', missing' when absent)."""
        shown = f"got {show_value(self.obj[field])}" if field in self.obj else "missing"
        raise TraceError(f"{self.where}: field '{field}': {msg}, {shown}")

    def required(self, field: str):
        if field not in self.obj:  # 'missing' once: fail() would add ', missing' to it
            raise TraceError(f"{self.where}: field '{field}': required field is missing")
        return self.obj[field]

    def int_field(self, field: str, minimum: int, required: bool = True, maximum: int | None = None):
        if field not in self.obj and not required:
            return None
        v = self.required(field)
        if not is_int(v) or v < minimum:
            self.fail(field, f"expected an integer >= {minimum}")
        if maximum is not None and v > maximum:
            self.fail(field, f"expected an integer from {minimum} to {maximum:,}")
        return v

    def length_field(self, field: str, minimum: int) -> int:
        """A token count: an integer from `minimum` to MAX_LENGTH."""
        return self.int_field(field, minimum, maximum=MAX_LENGTH)

    def str_field(self, field: str, required: bool = True, nonempty: bool = True):
        if field not in self.obj and not required:
            return None
        v = self.required(field)
        if not isinstance(v, str) or (nonempty and not v):
            self.fail(field, "expected a non-empty string" if nonempty else "expected a string")
        return v

    def float_field(self, field: str, most: float | None = None):
        if field not in self.obj:
            return None
        v = self.obj[field]
        if not is_number(v) or v < 0:
            self.fail(field, "expected a finite number >= 0")
        if most is not None and v > most:
            self.fail(field, f"expected at most {most:,} (seconds)")
        return float(v)


def _non_finite(value) -> bool:
    """Whether a JSON value holds NaN or an infinity anywhere (Python's json reads `NaN`,
    `Infinity` and `1e999`, but they are not JSON: written back, no strict reader takes them)."""
    stack = [value]
    while stack:  # a loop, not recursion: a value may be nested as deep as the parser allows
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def check_extra(chk: RowChecker, extra: dict) -> dict:
    """`extra` (the keys the format does not name), refused when a value holds a non-finite number."""
    for k, v in extra.items():
        if _non_finite(v):
            chk.fail(k, "expected JSON numbers to be finite (NaN and Infinity are not JSON)")
    return extra


def parse_meta(obj: dict, where: str) -> TraceMeta:
    chk = RowChecker(where, obj)
    version = obj.get("pbkv_trace")
    if not is_int(version) or version != 1:  # not true, not 1.0: exactly the integer 1
        chk.fail("pbkv_trace", "only trace format version 1 is supported")
    bs = chk.int_field("block_size", 1, required=False) or DEFAULT_BLOCK_SIZE
    fields = {k: chk.str_field(k, required=False, nonempty=False) for k in ("source", "license", "notes")}
    extra = check_extra(chk, {k: v for k, v in obj.items() if k not in META_FIELDS and k != "pbkv_trace"})
    return TraceMeta(block_size=bs, extra=extra, **fields)


def parse_call(obj: dict, where: str, block_size: int) -> Call:
    """Check one call line against every per-line rule of the format and build the `Call`."""
    chk = RowChecker(where, obj)
    wf = chk.str_field("workflow_id")
    step = chk.int_field("step", 0)
    agent = chk.str_field("agent")
    input_length = chk.length_field("input_length", 1)
    output_length = chk.length_field("output_length", 0)
    hash_ids = chk.required("hash_ids")
    if not isinstance(hash_ids, list) or not all(is_int(h) for h in hash_ids):
        chk.fail("hash_ids", "expected a list of integers")
    want = -(-input_length // block_size)
    if len(hash_ids) != want:
        chk.fail("hash_ids", f"expected {want} ids for input_length {input_length} and block_size "
                             f"{block_size}, found {len(hash_ids)}")
    done = obj.get("done")
    if "done" in obj and not isinstance(done, bool):
        chk.fail("done", "expected true or false")
    context = chk.str_field("context", required=False, nonempty=False)
    workload = chk.str_field("workload", required=False)
    t, tool_wait = chk.float_field("t"), chk.float_field("tool_wait", MAX_TOOL_WAIT)
    extra = check_extra(chk, {k: v for k, v in obj.items() if k not in CALL_FIELDS})  # checked last
    return Call(workflow_id=wf, step=step, agent=agent, input_length=input_length,
                output_length=output_length, hash_ids=hash_ids, workload=workload,
                t=t, tool_wait=tool_wait, context=context, done=done, extra=extra)


class _CrossLineChecks:
    """Rules that span lines: duplicate steps, gaps, `done` placement, hash-id chaining."""

    def __init__(self, name: str):
        self.name = name
        self.seen: dict[tuple[str, int], int] = {}  # (workflow, step) -> line
        self.parent: dict[int, tuple[int | None, int, int]] = {}  # id -> (predecessor, position, line)

    def add(self, call: Call, line: int):
        key = (call.workflow_id, call.step)
        if key in self.seen:
            raise TraceError(f"{self.name}:{line}: field 'step': duplicate step {call.step} of workflow "
                             f"{call.workflow_id!r} (first at line {self.seen[key]}), got {call.step}")
        self.seen[key] = line
        prev = None
        for pos, h in enumerate(call.hash_ids):
            known = self.parent.get(h)
            if known is None:
                self.parent[h] = (prev, pos, line)
            elif known[0] != prev or known[1] != pos:
                raise TraceError(
                    f"{self.name}:{line}: field 'hash_ids': id {h} at position {pos} follows {prev}, but at "
                    f"line {known[2]} it is at position {known[1]} after {known[0]} (ids must be chained), "
                    f"got {show_value(call.hash_ids)}")
            prev = h

    def finish(self, calls: list[Call], lines: list[int]):
        steps: dict[str, list[tuple[int, int, Call]]] = {}
        for call, line in zip(calls, lines):
            steps.setdefault(call.workflow_id, []).append((call.step, line, call))
        for wf, items in steps.items():
            items.sort(key=lambda x: x[0])
            for expect, (step, line, _) in enumerate(items):
                if step != expect:
                    raise TraceError(f"{self.name}:{line}: field 'step': workflow {wf!r} has no step "
                                     f"{expect} (steps must be 0..n-1 without gaps), got {step}")
            last = items[-1][0]
            for step, line, call in items:
                if call.done and step != last:
                    raise TraceError(f"{self.name}:{line}: field 'done': true on step {step} but workflow "
                                     f"{wf!r} continues to step {last}, got true")


def read_trace(path: str | Path) -> Trace:
    """Read and fully validate a trace file; raise `TraceError` (and nothing else, whatever the
    file holds) on the first violation, its message starting with FILE or FILE:LINE."""
    path = Path(path)
    name = display_name(path)
    meta = TraceMeta()
    calls: list[Call] = []
    lines: list[int] = []
    cross = _CrossLineChecks(name)
    for lineno, _, obj in read_lines(path, name):
        where = f"{name}:{lineno}"
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {show_value(obj)}")
        if "pbkv_trace" in obj:
            if calls:
                raise TraceError(f"{where}: field 'pbkv_trace': the metadata line must come before "
                                 f"every call, got {show_value(obj['pbkv_trace'])}")
            meta = parse_meta(obj, where)
            continue
        call = parse_call(obj, where, meta.block_size)
        cross.add(call, lineno)
        calls.append(call)
        lines.append(lineno)
    cross.finish(calls, lines)
    return Trace(meta=meta, calls=calls, path=str(path))


def validate(trace: Trace, name: str = "<trace>") -> None:
    """Check an in-memory trace with the same rules as `read_trace` (used on generated traces)."""
    cross = _CrossLineChecks(name)
    for i, call in enumerate(trace.calls, 1):
        parse_call(call_to_dict(call), f"{name}:call {i}", trace.block_size)
        cross.add(call, i)
    cross.finish(trace.calls, list(range(1, len(trace.calls) + 1)))


def call_to_dict(call: Call) -> dict:
    d = {"workflow_id": call.workflow_id, "step": call.step, "agent": call.agent}
    for k in ("workload", "t", "tool_wait"):
        v = getattr(call, k)
        if v is not None:
            d[k] = v
    d["input_length"] = call.input_length
    d["output_length"] = call.output_length
    d["hash_ids"] = call.hash_ids
    if call.context is not None:
        d["context"] = call.context
    if call.done is not None:
        d["done"] = call.done
    d.update(call.extra)
    return d


def meta_to_dict(meta: TraceMeta) -> dict:
    d = {"pbkv_trace": 1, "block_size": meta.block_size}
    for k in ("source", "license", "notes"):
        v = getattr(meta, k)
        if v is not None:
            d[k] = v
    d.update(meta.extra)
    return d


def iter_lines(trace: Trace) -> Iterable[str]:
    """The file's lines. allow_nan=False: a NaN put into an in-memory trace raises ValueError
    instead of writing a line that no reader (ours included) accepts."""
    yield json.dumps(meta_to_dict(trace.meta), separators=(",", ":"), allow_nan=False)
    for call in trace.calls:
        yield json.dumps(call_to_dict(call), separators=(",", ":"), allow_nan=False)


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write the metadata line then one line per call; gzip when the name ends in `.gz`.
    The file appears whole or not at all (`replaced_on_success`)."""
    path = Path(path)
    with replaced_on_success(path) as tmp, open_trace(tmp, "w") as f:
        for line in iter_lines(trace):
            f.write(line + "\n")
    return path
