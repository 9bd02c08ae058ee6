"""NVIDIA Dynamo's "Agentic Mooncake" replay rows (ai-dynamo/dynamo: docs/agents/agent-replay.md,
docs/dynosim/trace-formats.md), read and written.

What those pages document, in our words: each row is one LLM request with a unique `request_id`,
the `session_id` of its trajectory, Mooncake's `timestamp` (milliseconds), `input_length`,
`output_length` and `hash_ids`. `wait_for` lists request ids that must finish before the row may
start; a row without it starts at its `timestamp`. After its dependencies finish a row waits
`delay` (non-tool overhead, ms) plus `tool_wait_ms` (tool time, ms; overlapping tools counted
once). `branches` lists child requests spawned from the row and `prefix_reset` marks a session's
first row: both are metadata the replay does not schedule by. The files do not record their block
size (Dynamo's converter prints it), so the importer needs `--source-block-size`.

pbkv's model is a sequence of steps per workflow, so a session becomes a workflow (steps in file
order, except that a row comes after every row of its session it waits for: a note counts the rows
listed before their dependency) and `tool_wait` = (`delay` + `tool_wait_ms`) / 1000 s before each
step after the first. A first row waits for nothing, so its own `delay`/`tool_wait_ms` are not
kept (a note counts them); the export writes a first call's `tool_wait` as a later `timestamp`.
Every edge other than "previous row of the same session -> next row" is reported with its kind:
`spawn` (into another session's first row), `join` (into a later row of another session), `skip`
(same session, not consecutive) or `dangling` (a row cut by `--limit`). The agent is the row's
`agent` field when present (pbkv's export writes it), else `subagent` for a session spawned by
another one and `main` otherwise. A row without `session_id` is its own trajectory, a workflow
named by its `request_id` (`<request_id>#<k>` when a `session_id` of the file is that id, so it
joins no other session). A row that waits for itself, directly or through other rows (a
`wait_for` cycle of any length), is an error naming the cycle's rows and lines (Dynamo's replay
would deadlock), and so is a row whose `branches` names itself.
When `--limit` stops before the end of the file, no session's last kept row gets `done`.

The export writes `delay_ms` (where the import keeps `delay`) back as `delay` and the rest of
`tool_wait` as `tool_wait_ms`, refusing a `delay_ms` that is not a finite number >= 0 or that exceeds
the call's `tool_wait` (in ms; no `tool_wait` is no wait): the row would wait longer than the call
does in pbkv's replay, and no `tool_wait_ms` >= 0 could make up the difference; it refuses as well a `t`
or `tool_wait` whose milliseconds overflow to inf (above MAX_SECONDS); `context` and other extra keys have no field in these rows and
are not written (a note counts them), nor has the metadata line (a note names the license, source,
notes and other keys; a metadata `workload` is written on every row without its own).
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from typing import IO, Callable

from pbkv.trace.call import Call, Trace
from pbkv.trace.formats.base import (Edge, ExportReport, ImportReport, Row, lengths_and_ids, number, session_done,
                                     str_list)
from pbkv.trace.io import RowChecker, is_number, show_value

BLOCK_SIZE = None  # not recorded in the files
# The longest time (s) whose milliseconds are still a finite float: rows hold times in ms (x 1000),
# and a valid trace's t or tool_wait (any finite number) may be larger (1.7e308 s).
MAX_SECONDS = sys.float_info.max / 1000.0


def _parse(row: Row, block_size: int) -> dict:
    chk = row.chk
    out = {"request_id": chk.str_field("request_id"),
           "session_id": chk.str_field("session_id", required=False),
           "timestamp": number(chk, "timestamp"), "delay": number(chk, "delay"),
           "tool_wait_ms": number(chk, "tool_wait_ms"),
           "wait_for": str_list(chk, "wait_for"), "branches": str_list(chk, "branches"),
           "agent": chk.str_field("agent", required=False), "workload": chk.str_field("workload", required=False)}
    if "prefix_reset" in chk.obj and not isinstance(chk.obj["prefix_reset"], bool):
        chk.fail("prefix_reset", "expected true or false")
    if not out["wait_for"] and out["timestamp"] is None:
        chk.fail("timestamp", "required on a row without wait_for (it is the row's start time)")
    if out["request_id"] in out["wait_for"]:  # Dynamo's replay would wait forever for this row
        chk.fail("wait_for", f"names the row's own request_id {out['request_id']!r}: a row cannot wait for "
                             f"itself (a deadlock in Dynamo's replay)")
    if out["request_id"] in out["branches"]:  # a row is not its own child: the edge says nothing real
        chk.fail("branches", f"names the row's own request_id {out['request_id']!r}: a row cannot spawn itself")
    out["lengths"] = lengths_and_ids(chk, block_size)
    return out


def read(rows: list[Row], block_size: int, report: ImportReport) -> list[Call]:
    """One workflow per session, steps in file order after what they wait for (`_steps`); DAG
    edges beyond the sequence are reported."""
    parsed, where = [], {}  # where: request_id -> row
    for row in rows:
        p = _parse(row, block_size)
        rid = p["request_id"]
        if rid in where:
            row.chk.fail("request_id", f"duplicate request_id (first at line {where[rid].line})")
        where[rid] = row
        parsed.append(p)
    _refuse_cycles(parsed, where)
    place = _steps(parsed, _sessions(parsed, report), report)  # request_id -> (session, step)
    steps: dict[str, int] = {}
    for session, step in place.values():
        steps[session] = max(steps.get(session, 0), step + 1)
    spawned = _edges(parsed, where, place, report)
    calls = []
    for p in parsed:
        session, step = place[p["request_id"]]
        input_length, output_length, ids = p["lengths"]
        waits = [p[k] for k in ("delay", "tool_wait_ms") if p[k] is not None]
        calls.append(Call(
            workflow_id=session, step=step, agent=p["agent"] or ("subagent" if session in spawned else "main"),
            workload=p["workload"] or "agentic-mooncake", input_length=input_length,
            output_length=output_length, hash_ids=ids,
            t=None if p["timestamp"] is None else p["timestamp"] / 1000.0,
            tool_wait=sum(waits) / 1000.0 if step and waits else None,
            done=session_done(step == steps[session] - 1, report),
            extra={"delay_ms": p["delay"]} if step and p["delay"] else {}))
    unwaited = [p for p in parsed if not place[p["request_id"]][1] and not p["wait_for"] and (p["delay"] or p["tool_wait_ms"])]
    if unwaited:
        report.notes.append(f"{len(unwaited)} session first rows without wait_for carry `delay`/`tool_wait_ms` "
                            f"(first: {unwaited[0]['request_id']!r}): not kept, as Dynamo waits them only after a "
                            f"row's dependencies and these rows start at their `timestamp`")
    return calls


def _refuse_cycles(parsed: list[dict], where: dict[str, Row]) -> None:
    """Raise `TraceError` when `wait_for` links form a cycle (Dynamo's replay would wait forever
    for all its rows), at the line of the cycle's first row in the file, naming every member in
    waiting order with its line. Links to rows not in the file (cut by `--limit`) cannot close a
    cycle and are left to `_edges`; a row waiting for itself was refused by `_parse`."""
    cycle = _wait_cycle(parsed, where)
    if cycle is None:
        return
    first = min(range(len(cycle)), key=lambda i: where[cycle[i]].line)
    cycle = cycle[first:] + cycle[:first]
    chain = ", which waits for ".join(f"{rid!r} (line {where[rid].line})" for rid in cycle)
    where[cycle[0]].chk.fail("wait_for", f"wait_for links form a cycle of {len(cycle)} rows: {chain}, which waits "
                                         f"for {cycle[0]!r} (a deadlock in Dynamo's replay)")


def _wait_cycle(parsed: list[dict], where: dict[str, Row]) -> list[str] | None:
    """Request ids of one `wait_for` cycle, each waiting for the next and the last for the first;
    None when the links form no cycle. An iterative depth-first search: a session of thousands of
    chained rows must not hit Python's recursion limit."""
    deps = {p["request_id"]: [d for d in p["wait_for"] if d in where] for p in parsed}
    state: dict[str, bool] = {}  # request_id -> still on the search path (False: finished, no cycle)
    for p in parsed:
        if p["request_id"] in state:
            continue
        path, todo = [p["request_id"]], [iter(deps[p["request_id"]])]
        state[p["request_id"]] = True
        while path:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = False
                todo.pop()
            elif state.get(nxt):
                return path[path.index(nxt):]
            elif nxt not in state:
                state[nxt] = True
                path.append(nxt)
                todo.append(iter(deps[nxt]))
    return None


def _sessions(parsed: list[dict], report: ImportReport) -> list[str]:
    """The session (workflow id) of each row. A row without `session_id` is its own trajectory,
    named by its request_id, unless some row's `session_id` is that id: it would silently join
    that session, so it is named `<request_id>#<k>` with the least k >= 1 that neither a
    `session_id` nor another row's name uses. Invariant: distinct trajectories get distinct names."""
    named = {p["session_id"] for p in parsed if p["session_id"]}
    taken = named | {p["request_id"] for p in parsed if not p["session_id"]}
    out, renamed = [], []
    for p in parsed:
        name = p["session_id"] or p["request_id"]
        if not p["session_id"] and name in named:
            k = 1
            while f"{name}#{k}" in taken:
                k += 1
            name = f"{name}#{k}"
            taken.add(name)
            renamed.append(name)
        out.append(name)
    if renamed:
        report.notes.append(f"{len(renamed)} row(s) without session_id have a request_id that is also a "
                            f"session_id in the file: each is its own workflow, renamed (first: {renamed[0]!r})")
    return out


def _steps(parsed: list[dict], sessions: list[str], report: ImportReport) -> dict[str, tuple[str, int]]:
    """request_id -> (session, step): a session's rows in file order, except that a row comes
    after every row of its session it waits for (a row listed before its dependency would
    otherwise run first in pbkv's replay: the dependency reversed). Among rows free to go, file
    order decides. Invariant: every in-session `wait_for` edge goes from a lower step to a
    higher one (`_refuse_cycles` ran first, so such an order exists)."""
    index = {p["request_id"]: i for i, p in enumerate(parsed)}
    members: dict[str, list[int]] = {}
    for i, session in enumerate(sessions):
        members.setdefault(session, []).append(i)
    place, moved = {}, 0
    for session, rows in members.items():
        mine = set(rows)
        waiting = {i: {index[d] for d in parsed[i]["wait_for"] if index.get(d) in mine} for i in rows}
        users: dict[int, list[int]] = {}
        for i in rows:
            for d in waiting[i]:
                users.setdefault(d, []).append(i)
        moved += sum(any(d > i for d in waiting[i]) for i in rows)
        ready = [i for i in rows if not waiting[i]]   # file indices: a heap gives file order
        heapq.heapify(ready)
        step = 0
        while ready:
            i = heapq.heappop(ready)
            place[parsed[i]["request_id"]] = (session, step)
            step += 1
            for u in users.get(i, ()):
                waiting[u].discard(i)
                if not waiting[u]:
                    heapq.heappush(ready, u)
    if moved:
        report.notes.append(f"{moved} rows are listed before a row of their session that they wait for: "
                            f"steps follow wait_for (then file order), so each runs after what it waits for")
    return place


def _edges(parsed: list[dict], where: dict, place: dict, report: ImportReport) -> set[str]:
    """Classify every wait_for / branches edge; return the sessions whose first row was spawned."""
    pairs = [(d, p["request_id"], "wait_for", p) for p in parsed for d in p["wait_for"]]
    pairs += [(p["request_id"], b, "branches", p) for p in parsed for b in p["branches"]]
    spawned, seen = set(), set()
    for src, dst, name, p in pairs:  # wait_for first: its row carries the edge's delay
        if (src, dst) in seen:
            continue
        seen.add((src, dst))
        other = dst if name == "branches" else src
        if other not in place:
            if not report.limited:
                where[p["request_id"]].chk.fail(name, f"names request {other!r}, which is not in the file")
            report.dropped_edges.append(Edge(src, dst, "dangling"))
            continue
        (s1, k1), (s2, k2) = place[src], place[dst]
        if s1 == s2 and k2 == k1 + 1:
            continue
        kind = "skip" if s1 == s2 else ("spawn" if k2 == 0 else "join")
        if kind == "spawn":
            spawned.add(s2)
        wait = sum(v for v in (p["delay"], p["tool_wait_ms"]) if v is not None) if name == "wait_for" else 0.0
        report.dropped_edges.append(Edge(src, dst, kind, wait))
    unordered = 0
    for p in parsed:
        session, step = place[p["request_id"]]
        unordered += bool(step) and (session, step - 1) not in {place.get(d) for d in p["wait_for"]}
    if unordered:
        report.notes.append(f"{unordered} rows do not wait for the previous row of their session; "
                            f"pbkv runs them after it (its workflows are sequences)")
    return spawned


def _step_order(trace: Trace) -> list[Call]:
    """File order, except each workflow's calls are put in step order into the slots it occupies."""
    by_wf = {wf: iter(calls) for wf, calls in trace.workflows().items()}
    return [next(by_wf[c.workflow_id]) for c in trace.calls]


def check(trace: Trace, where: Callable[[int], str]) -> None:
    """Raise `TraceError` (at `where(index)`, the call's FILE:LINE) for a value `write` would write
    wrongly: `delay_ms` (pbkv's import keeps Dynamo's `delay` there; written back as `delay` on
    steps after the first) must be a finite number >= 0, as the importer requires of `delay`, and
    at most the call's `tool_wait` in ms. Invariant of an accepted trace: every written row's
    `delay` + `tool_wait_ms` is its call's `tool_wait` x 1000 (0 when absent), and every time
    written in ms is a finite number (`_check_ms`)."""
    for i, call in enumerate(trace.calls):
        _check_ms(call, where(i))
        v = call.extra.get("delay_ms", 0.0)
        if not call.step:
            continue
        if not (is_number(v) and v >= 0):
            RowChecker(where(i), call.extra).fail(
                "delay_ms", "expected a finite number >= 0 (milliseconds: written as Dynamo's `delay`)")
        if _exceeds(v, call.tool_wait):
            RowChecker(where(i), call.extra).fail("delay_ms", _too_long(call.tool_wait))


def _check_ms(call: Call, where: str) -> None:
    """`TraceError` at `where` naming `t` or `tool_wait` when the milliseconds `write` makes of it
    are not a finite number (they would overflow to inf, which no JSON holds): `t` x 1000, and
    `tool_wait` x 1000, on a first call added to `t` (its row's `timestamp`)."""
    first = not call.step
    written = {"t": call.t or 0.0, "tool_wait": (call.tool_wait or 0.0) + (call.t or 0.0) * first}
    for name, seconds in written.items():
        if not math.isfinite(seconds * 1000.0):
            plus = (" together with t (a first row's timestamp is t + tool_wait)"
                    if name == "tool_wait" and first else "")
            RowChecker(where, {name: getattr(call, name)}).fail(
                name, f"expected at most {MAX_SECONDS:.4g} s{plus}: written in milliseconds, which must be "
                      f"a finite number")


def _exceeds(delay_ms: float, tool_wait: float | None) -> bool:
    """Whether `delay_ms` is more than the whole wait `tool_wait` (s; None: no wait). Dynamo waits
    `delay` + `tool_wait_ms` and pbkv keeps that sum whole in `tool_wait`, so a `delay` above it
    would make the exported row wait longer than pbkv's replay does. The slack absorbs the float
    error of the import's (delay + tool_wait_ms) / 1000 and the export's x 1000."""
    total = (tool_wait or 0.0) * 1000.0
    return delay_ms > total + 1e-9 * max(1.0, total)


def _too_long(tool_wait: float | None) -> str:
    """What `check` expected of a `delay_ms` that exceeds the call's `tool_wait`."""
    have = "no tool_wait (no wait)" if tool_wait is None else f"tool_wait {tool_wait:g} s"
    return (f"expected at most the call's tool_wait in ms (Dynamo's `delay` is part of the wait "
            f"`delay` + `tool_wait_ms` that pbkv keeps whole in tool_wait; this call has {have})")


def write(trace: Trace, f: IO[str]) -> ExportReport:
    """One row per call; a step waits for the previous step of its workflow, then for its tool_wait.
    The trace must pass `check` (`export_file` runs it before opening the output)."""
    report = ExportReport("agentic-mooncake", block_size=trace.block_size)
    untimed = first_waits = 0
    named = trace.meta.extra.get("workload")   # a workload named only by the metadata line
    for call in _step_order(trace):
        row: dict = {"request_id": f"{call.workflow_id}:{call.step}", "session_id": call.workflow_id}
        if call.step == 0:
            # a first row has no dependencies, and Dynamo waits `delay`/`tool_wait_ms` only after
            # those: a first call's tool_wait is kept by starting the row that much later
            untimed += call.t is None
            first_waits += bool(call.tool_wait)
            row["timestamp"] = round(((call.t or 0.0) + (call.tool_wait or 0.0)) * 1000.0, 3)
        elif call.t is not None:
            row["timestamp"] = round(call.t * 1000.0, 3)
        row.update(input_length=call.input_length, output_length=call.output_length, hash_ids=call.hash_ids,
                   wait_for=[])
        if call.step:
            delay = float(call.extra.get("delay_ms", 0.0))
            tool = max(0.0, round((call.tool_wait or 0.0) * 1000.0 - delay, 3))
            row.update(wait_for=[f"{call.workflow_id}:{call.step - 1}"], delay=delay)
            if tool > 0:
                row["tool_wait_ms"] = tool
        row.update(branches=[], prefix_reset=call.step == 0, agent=call.agent)
        workload = call.workload if call.workload is not None else named
        if isinstance(workload, str):
            row["workload"] = workload
        # allow_nan=False: a NaN that got past the checks fails here rather than as a row no reader takes
        f.write(json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n")
        report.rows += 1
    report.workflows = len({c.workflow_id for c in trace.calls})
    if untimed:
        report.notes.append(f"{untimed} workflows have no arrival time `t`: their first rows start at timestamp 0 "
                            f"(plus the first call's tool_wait, if any)")
    if first_waits:
        report.notes.append(f"{first_waits} workflows' first call has a tool_wait: written as a later `timestamp` "
                            f"of its row (Dynamo waits `delay`/`tool_wait_ms` only after a row's dependencies, "
                            f"and a first row has none); read back, the wait is part of the arrival time, not "
                            f"of the workflow's latency")
    for dropped in (_not_written(trace), _meta_not_written(trace.meta)):
        if dropped:
            report.notes.append(dropped)
    return report


def _meta_not_written(meta) -> str | None:
    """One line naming the metadata the rows have no place for (the files have no metadata
    line): the license above all, which a copy of the trace would otherwise lose unannounced.
    A metadata `workload` is not named: it is written on every row without its own."""
    parts = [f"{k} {show_value(v)}" for k, v in (("license", meta.license), ("source", meta.source),
                                                  ("notes", meta.notes)) if v is not None]
    parts += [show_value(k) for k in meta.extra if k != "workload"]
    if not parts:
        return None
    return "not written (agentic-mooncake files have no metadata line): " + ", ".join(parts)


def _not_written(trace: Trace, shown: int = 5) -> str | None:
    """One line naming what the rows have no field for, with how many calls had it: `context`
    and extra keys (all but `delay_ms` after the first step, written as `delay`). A re-import
    therefore lacks them; Dynamo's format has no place for them, so none is invented."""
    context = sum(c.context is not None for c in trace.calls)
    keys: dict[str, int] = {}
    for call in trace.calls:
        for k in call.extra:
            if k != "delay_ms" or not call.step:
                keys[k] = keys.get(k, 0) + 1
    parts = [f"`context` on {context} call{'s' if context != 1 else ''}"] if context else []
    if keys:
        items = [f"{show_value(k)} on {n}" for k, n in list(keys.items())[:shown]]
        more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
        parts.append(f"extra keys ({', '.join(items)}{more})")
    if not parts:
        return None
    return "not written (agentic-mooncake rows have no field for it): " + "; ".join(parts)
