"""Qwen-Bailian usage traces (alibaba-edu/qwen-bailian-usagetraces-anon, `*_blksz_16.jsonl`).

What the dataset README documents: one request per line with `chat_id` (integer), `parent_chat_id`
(-1 for a root request), `timestamp` (seconds from the trace start), `input_length`,
`output_length`, `type` (text / search / image / file), `turn` (conversation turn) and `hash_ids`
(salted hashes of 16-token blocks, remapped to integers).

Sessions are rebuilt from the parent links: a root and all its descendants form one workflow
`bailian-<root chat_id>`, steps ordered by `turn`, then `timestamp`, then file line; `type` is the
agent and `t` the timestamp. A chat whose parent is not in the file (outside the two-hour window,
or cut by `--limit`) starts its own workflow. A parent with several children (a tree, not a chain)
cannot be one sequence: every parent link that does not join consecutive steps is reported.

Timing: `t` is each chat's `timestamp`. pbkv's replay starts a workflow at its first step's `t` and
issues every later step `tool_wait` seconds after the previous step finishes (later `t`s are not
replayed), so each later step's own timestamp becomes its `tool_wait`: the gap since the previous
step's arrival, `t[k] - t[k-1]`. The traces record arrivals only, not when a reply ended, so this
gap also holds the previous chat's service time: it is an upper bound on the user's think time,
and a replay at the traced speed issues each step no earlier after its predecessor than the trace
did. A step that arrived before its predecessor (steps are ordered by turn first, and siblings of
a tree may interleave in time) gets `tool_wait` 0, and a note counts such steps.

When `--limit` stops before the end of the file, a conversation may go on past the cut, so no
workflow's last kept step gets `done`.
"""

from __future__ import annotations

from pbkv.trace.call import Call
from pbkv.trace.formats.base import Edge, ImportReport, Row, lengths_and_ids, number, session_done
from pbkv.trace.io import TraceError

BLOCK_SIZE = 16


def read(rows: list[Row], block_size: int, report: ImportReport) -> list[Call]:
    """Calls in file order, grouped into workflows by root chat (ids still raw)."""
    chats: dict[int, tuple[Row, int, Call]] = {}  # chat_id -> (row, parent, call)
    order: dict[int, tuple[int, float, int]] = {}  # chat_id -> sort key inside its workflow
    for row in rows:
        chk = row.chk
        chat = chk.int_field("chat_id", 0)
        if chat in chats:
            chk.fail("chat_id", f"duplicate chat_id (first at line {chats[chat][0].line})")
        parent = chk.int_field("parent_chat_id", -1)
        if parent == chat:
            chk.fail("parent_chat_id", "a chat cannot be its own parent")
        timestamp = number(chk, "timestamp", required=True)
        agent = chk.str_field("type")
        turn = chk.int_field("turn", 0)
        input_length, output_length, ids = lengths_and_ids(chk, block_size)
        chats[chat] = (row, parent, Call(workflow_id="", step=0, agent=agent, workload="bailian",
                                         input_length=input_length, output_length=output_length,
                                         hash_ids=ids, t=timestamp))
        order[chat] = (turn, timestamp, row.line)
    roots = _roots(chats, report)
    members: dict[int, list[int]] = {}
    for chat in chats:
        members.setdefault(roots[chat], []).append(chat)
    early = 0
    for root, group in members.items():
        group.sort(key=order.__getitem__)
        for step, chat in enumerate(group):
            call = chats[chat][2]
            call.workflow_id, call.step = f"bailian-{root}", step
            call.done = session_done(step == len(group) - 1, report)
        early += _set_waits([chats[chat][2] for chat in group])
    if early:
        report.notes.append(f"{early} chat(s) arrived before the previous step of their workflow (steps are "
                            f"ordered by turn, then timestamp): their tool_wait is 0")
    _report_branches(chats, report)
    return [call for _, _, call in chats.values()]


def _set_waits(steps: list[Call]) -> int:
    """Give each step after the first `tool_wait` = its arrival `t` minus the previous step's (s,
    rounded to the microsecond, clamped at 0); return how many were clamped. Invariant: the first
    step keeps no `tool_wait` (its `t` starts the workflow)."""
    early = 0
    for prev, call in zip(steps, steps[1:]):
        gap = call.t - prev.t
        early += gap < 0
        call.tool_wait = round(max(0.0, gap), 6)
    return early


def _roots(chats: dict[int, tuple[Row, int, Call]], report: ImportReport) -> dict[int, int]:
    """chat -> the root of its tree; a parent missing from the file makes the chat a root."""
    roots: dict[int, int] = {}
    orphans = 0
    for start in chats:
        path, chat = [], start
        while chat not in roots:
            if chat in path:
                row = chats[chat][0]
                raise TraceError(f"{row.where}: field 'parent_chat_id': parent links form a cycle through "
                                 f"chats {sorted(path[path.index(chat):])}, got {chats[chat][1]}")
            path.append(chat)
            parent = chats[chat][1]
            if parent not in chats:
                roots[chat] = chat
                orphans += parent != -1
                break
            chat = parent
        for c in path:
            roots[c] = roots[chat]
    if orphans:
        report.notes.append(f"{orphans} chat(s) name a parent that is not in the file (outside the trace "
                            f"window or cut by --limit): each starts its own workflow")
    return roots


def _report_branches(chats: dict[int, tuple[Row, int, Call]], report: ImportReport) -> None:
    """Parent links that the step order does not express (the child is not the parent's next step)."""
    for chat, (_, parent, call) in chats.items():
        if parent in chats:
            p = chats[parent][2]
            if p.workflow_id != call.workflow_id or p.step + 1 != call.step:
                report.dropped_edges.append(Edge(str(parent), str(chat), "branch"))
