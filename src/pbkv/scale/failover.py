"""What the ingress does when a call's engine replica fails. No Ray here (unit-tested).

A call is retried once, on another replica, when its replica was lost (the actor died or is
unreachable) before any of the call's text reached the client: a plain (non-streamed) answer
is sent whole at the end, so it is always retriable; a streamed one only until its first
text piece was forwarded (the SSE role chunk carries no text, so a retry stays seamless).
A call whose replica is lost after that, or a second time, ends with a `replica_failed` error
(a 503 for a plain answer, an error event in the stream). An error raised by the engine itself
(not a lost replica) is the engine's answer, as in one process: never retried.
"""

from __future__ import annotations

from enum import Enum


class Action(str, Enum):
    RETRY = "retry"     # send the call again, avoiding the replica that failed
    FAIL = "fail"       # end it with a replica_failed error (counted as failed)
    ERROR = "error"     # the engine's own error: end it with engine_error (not a replica failure)


def decide(replica_lost: bool, text_sent: bool, retries: int, max_retries: int = 1) -> Action:
    """The action after a call's stream from a replica raised (see the module docstring)."""
    if not replica_lost:
        return Action.ERROR
    if text_sent or retries >= max_retries:
        return Action.FAIL
    return Action.RETRY


def route_hints(workflow_id: str, agent: str | None, hash_ids: list[int], input_tokens: int,
                output_tokens: int, avoid: list[str] | None = None, done: bool = False) -> dict:
    """The dict the router reads among a call's arguments (`pbkv.scale.adapter.route_request`);
    `avoid`: replica ids a retry must not go to (when another replica is there); `done`: the call
    ends its workflow (the router forgets the workflow once it placed it)."""
    out = {"workflow_id": workflow_id, "agent": agent or "", "hash_ids": list(hash_ids),
           "input_tokens": input_tokens, "output_tokens": output_tokens, "done": bool(done)}
    if avoid:
        out["avoid"] = list(avoid)
    return out
