"""Rewrite traces: split one by task, or strip its workflow structure.

- `split_by_task`: two traces with no task in both (grouped by the task line of the first
  call's context when there is one, else by workflow; see `task_groups`), each group's side
  chosen by a hash of it, so the split is stable across runs and machines; each part's metadata says which part it is and drops
  whole-file counts (`part_meta`);
- `flatten`: every call becomes its own one-call workflow (same prompts, same order): a trace
  with no workflow structure, on which a workflow-aware policy must not lose to LRU.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from pbkv.trace.call import Call, Trace, TraceMeta


# `pbkv gen` writes the whole context on one line, "task: TEXT (words) | turn: WORDS | agent: NAME":
# only the part before the first of these fields is the task.
_GENERATED_FIELDS = re.compile(r" \| (?:turn|agent): ")


def task_key(calls: list[Call]) -> str:
    """The task of a workflow: the first line of step 0's context when it starts with "task:"
    (ChatDev: runs of one task), cut before a generated trace's " | turn: " / " | agent: " fields;
    otherwise the workflow id."""
    first = (calls[0].context or "").split("\n", 1)[0]
    return _GENERATED_FIELDS.split(first, 1)[0] if first.startswith("task:") else calls[0].workflow_id


def task_groups(trace: Trace) -> dict[str, list[str]]:
    """Task key -> its workflow ids (file order). When the task lines name fewer than two tasks (a
    generated spec without task variables: every workflow says "task: NAME", yet each drew its own
    task statement), every workflow is its own group. Invariant: every workflow is in exactly one group."""
    workflows = trace.workflows()
    groups: dict[str, list[str]] = {}
    for wf, calls in workflows.items():
        groups.setdefault(task_key(calls), []).append(wf)
    return groups if len(groups) >= 2 else {wf: [wf] for wf in workflows}


def split_by_task(trace: Trace, test_fraction: float = 0.5, seed: int = 0) -> tuple[Trace, Trace]:
    """(train, test) with no task group in both (`task_groups`): a group is in test iff
    sha1(seed:key) / 2^160 < test_fraction, so the split is the same in every process and a
    group's side never depends on the other groups (the halves of the real traces that published
    figures were measured on stay as they were). Few groups may miss the fraction. Calls keep
    file order."""
    if not 0 <= test_fraction <= 1:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    test_ids: set[str] = set()
    for key, wfs in task_groups(trace).items():
        if int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest(), 16) / 16 ** 40 < test_fraction:
            test_ids.update(wfs)
    parts = []
    for name, calls in (("train", [c for c in trace.calls if c.workflow_id not in test_ids]),
                        ("test", [c for c in trace.calls if c.workflow_id in test_ids])):
        label = f"{name} part of a split by task (seed {seed}, test fraction {test_fraction:g})"
        parts.append(replace(trace, meta=part_meta(trace.meta, label), calls=calls))
    return parts[0], parts[1]


# Metadata keys that count something over the whole file (the importer's `dropped_edges`): a part
# would claim them for a subset, and they cannot be recounted from its calls.
WHOLE_FILE_KEYS = ("dropped_edges",)


def part_meta(meta: TraceMeta, part: str) -> TraceMeta:
    """The metadata of a part of a trace (a new object, `meta` is unchanged): `notes` say which part
    (`part`), the whole file's notes (which may count its rows) kept after "whole file:", and the
    `WHOLE_FILE_KEYS` dropped. Invariant: no count in a part's metadata claims to describe the part
    unless it was counted on it."""
    notes = part + (f"; whole file: {meta.notes}" if meta.notes else "")
    extra = {k: v for k, v in meta.extra.items() if k not in WHOLE_FILE_KEYS}
    return replace(meta, notes=notes, extra=extra)


def require_both_parts(train: Trace, test: Trace, where: str,
                       advice: str = "try another --seed or --test-fraction") -> None:
    """Raise ValueError (naming `where`) when a split left one part without workflows: an empty
    half would fail later, in training or replay, far from its cause. `advice` names only options
    the calling command has (predict-eval has no --test-fraction)."""
    if train.calls and test.calls:
        return
    groups = len(task_groups(replace(train, calls=train.calls + test.calls)))
    if groups < 2:
        raise ValueError(f"{where}: holds {groups} task group(s); a split needs at least two")
    full, empty = ("train", "test") if train.calls else ("test", "train")
    raise ValueError(f"{where}: all {groups} task groups fell in the {full} part, none in {empty}: "
                     f"{advice}")


def flatten(trace: Trace) -> Trace:
    calls = []
    for call in trace.calls:
        calls.append(replace(call, workflow_id=f"{call.workflow_id}#{call.step}", step=0, done=True,
                             tool_wait=None, extra=dict(call.extra)))
    return replace(trace, calls=calls)
