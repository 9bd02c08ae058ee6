"""Rewrite traces: split one by task, or strip its workflow structure.

- `split_by_task`: two traces with no task in both (grouped by the task line of the first
  call's context when there is one, else by workflow), chosen by a hash of the group, so the
  split is stable across runs and machines; each part's metadata says which part it is and drops
  whole-file counts (`part_meta`);
- `flatten`: every call becomes its own one-call workflow (same prompts, same order): a trace
  with no workflow structure, on which a workflow-aware policy must not lose to LRU.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from pbkv.trace.call import Call, Trace, TraceMeta


def task_key(calls: list[Call]) -> str:
    """The task of a workflow: the first line of step 0's context when it starts with "task:"
    (ChatDev: runs of one task), otherwise the workflow id."""
    first = (calls[0].context or "").split("\n", 1)[0]
    return first if first.startswith("task:") else calls[0].workflow_id


def split_by_task(trace: Trace, test_fraction: float = 0.5, seed: int = 0) -> tuple[Trace, Trace]:
    """(train, test): a workflow is in test iff sha1(seed:task key) / 2^160 < test_fraction, so all
    runs of one task land on the same side, the same way in every process. Calls keep file order."""
    if not 0 <= test_fraction <= 1:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    test_ids = set()
    for wf, calls in trace.workflows().items():
        if int(hashlib.sha1(f"{seed}:{task_key(calls)}".encode()).hexdigest(), 16) / 16 ** 40 < test_fraction:
            test_ids.add(wf)
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


def require_both_parts(train: Trace, test: Trace, where: str) -> None:
    """Raise ValueError (naming `where`) when a split left one part without workflows: an empty
    half would fail later, in training or replay, far from its cause."""
    if train.calls and test.calls:
        return
    groups = len({task_key(calls) for t in (train, test) for calls in t.workflows().values()})
    if groups < 2:
        raise ValueError(f"{where}: holds {groups} task group(s); a split needs at least two")
    full, empty = ("train", "test") if train.calls else ("test", "train")
    raise ValueError(f"{where}: all {groups} task groups fell in the {full} part, none in {empty}: "
                     f"try another --seed or --test-fraction")


def flatten(trace: Trace) -> Trace:
    calls = []
    for call in trace.calls:
        calls.append(replace(call, workflow_id=f"{call.workflow_id}#{call.step}", step=0, done=True,
                             tool_wait=None, extra=dict(call.extra)))
    return replace(trace, calls=calls)
