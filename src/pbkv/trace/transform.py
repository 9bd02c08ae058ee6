"""Rewrite traces: split one by task, or strip its workflow structure.

- `split_by_task`: two traces with no task in both (grouped by the task line of the first
  call's context when there is one, else by workflow), chosen by a hash of the group, so the
  split is stable across runs and machines;
- `flatten`: every call becomes its own one-call workflow (same prompts, same order): a trace
  with no workflow structure, on which a workflow-aware policy must not lose to LRU.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from pbkv.trace.call import Call, Trace


def task_key(calls: list[Call]) -> str:
    first = (calls[0].context or "").split("\n", 1)[0]
    return first if first.startswith("task:") else calls[0].workflow_id


def split_by_task(trace: Trace, test_fraction: float = 0.5, seed: int = 0) -> tuple[Trace, Trace]:
    train, test = [], []
    for calls in trace.workflows().values():
        digest = hashlib.sha1(f"{seed}:{task_key(calls)}".encode()).digest()
        side = test if int.from_bytes(digest[:8], "big") / 2 ** 64 < test_fraction else train
        side.extend(calls)
    return replace(trace, calls=train), replace(trace, calls=test)


def flatten(trace: Trace) -> Trace:
    calls = []
    for call in trace.calls:
        calls.append(replace(call, workflow_id=f"{call.workflow_id}#{call.step}", step=0, done=True,
                             tool_wait=None, extra=dict(call.extra)))
    return replace(trace, calls=calls)
