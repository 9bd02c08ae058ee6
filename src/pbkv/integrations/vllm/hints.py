"""Workflow hints from a request's `kv_transfer_params` (the OpenAI request field of the same name).

    {"workflow_id": "task-17", "agent": "planner", "workflow_done": false}

All fields are optional. A request without `workflow_id` is a workflow of its own that ends
with the request (as in `pbkv serve`), so unhinted traffic behaves like plain vLLM plus a
retired-first cache. `workflow_done: true` ends the workflow when this request finishes; without a usable
`workflow_id` (absent, or ignored as below) `workflow_done` is ignored too and the request always
ends its own one-call workflow.

Hints only steer the cache, so a malformed field is ignored rather than failing the request, and
`parse_hints` never raises on anything a JSON client can send. `workflow_id` and `agent` are
labels read as the Ray Serve router reads them (`pbkv.scale.llm_hints._label`), so a call keeps
its workflow whether it reached vLLM through the router or directly: a string or an integer
(JSON booleans are not ids: `true` must not become the workflow "True"), surrounding whitespace
removed, then 1 to `MAX_HINT_CHARS` characters. A longer label is ignored, not truncated: two
long ids that share their first 256 characters must not merge into one workflow (`pbkv serve`
refuses such a request with a 400; a connector cannot refuse, so it drops the hint).
`workflow_done` counts only as a JSON boolean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pbkv.trace import DEFAULT_AGENT

MAX_HINT_CHARS = 256   # as `pbkv serve` (serve/schemas.py) and the router (scale/llm_hints.py)
# the ints whose decimal form fits MAX_HINT_CHARS; checked before str(), which raises past 4300 digits
_INT_RANGE = (-10 ** (MAX_HINT_CHARS - 1), 10 ** MAX_HINT_CHARS)


@dataclass(frozen=True)
class Hints:
    workflow_id: str | None
    agent: str
    done: bool

    @property
    def hinted(self) -> bool:
        return self.workflow_id is not None


def hint_label(value: Any) -> str | None:
    """A workflow id or agent name as a label, or None when it is not one (see the module docstring).
    Invariant: a returned label is stripped and 1 to MAX_HINT_CHARS characters long."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    if isinstance(value, int) and not _INT_RANGE[0] < value < _INT_RANGE[1]:
        return None
    value = str(value).strip()
    return value if 0 < len(value) <= MAX_HINT_CHARS else None


def parse_hints(params) -> Hints:
    """`Hints` from a `kv_transfer_params` dict (or None)."""
    if not isinstance(params, dict):
        return Hints(None, DEFAULT_AGENT, True)
    wf = hint_label(params.get("workflow_id"))
    agent = hint_label(params.get("agent")) or DEFAULT_AGENT
    done = params.get("workflow_done")
    # without a usable id the call is a workflow of its own that ends with it: `workflow_done`
    # cannot keep it running (nothing could ever end it; its state would grow per request)
    done = True if wf is None else done if isinstance(done, bool) else False
    return Hints(wf, agent, done)
