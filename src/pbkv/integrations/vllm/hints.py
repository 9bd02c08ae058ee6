"""Workflow hints from a request's `kv_transfer_params` (the OpenAI request field of the same name).

    {"workflow_id": "task-17", "agent": "planner", "workflow_done": false}

All fields are optional. A request without `workflow_id` is a workflow of its own that ends
with the request (as in `pbkv serve`), so unhinted traffic behaves like plain vLLM plus a
retired-first cache. `workflow_done: true` ends the workflow when this request finishes.
Malformed fields are ignored rather than failing the request: hints only steer the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from pbkv.trace import DEFAULT_AGENT


@dataclass(frozen=True)
class Hints:
    workflow_id: str | None
    agent: str
    done: bool

    @property
    def hinted(self) -> bool:
        return self.workflow_id is not None


def parse_hints(params) -> Hints:
    """`Hints` from a `kv_transfer_params` dict (or None)."""
    if not isinstance(params, dict):
        return Hints(None, DEFAULT_AGENT, True)
    wf = params.get("workflow_id")
    wf = str(wf) if isinstance(wf, (str, int)) and str(wf) else None
    agent = params.get("agent")
    agent = str(agent)[:200] if isinstance(agent, str) and agent else DEFAULT_AGENT
    done = params.get("workflow_done")
    done = bool(done) if isinstance(done, bool) else wf is None
    return Hints(wf, agent, done)
