"""One LLM call of a workflow, and a whole trace (trace format v1: docs/trace-format.md).

Invariants of a `Trace` built by `pbkv.trace.io.read_trace` (or checked by `validate`):
- every call has `len(hash_ids) == ceil(input_length / block_size)`;
- the steps of each workflow are 0..n-1 without gaps or duplicates;
- hash ids are chained: an id always follows the same predecessor at the same position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BLOCK_SIZE = 16
DEFAULT_AGENT = "default"   # the agent of a call that names none (unhinted served calls, `generate`)


@dataclass(slots=True)
class Call:
    """One LLM call: which workflow and agent made it, what prompt it sent, how much it generated."""

    workflow_id: str
    step: int
    agent: str
    input_length: int
    output_length: int
    hash_ids: list[int]
    workload: str | None = None
    t: float | None = None
    tool_wait: float | None = None
    context: str | None = None
    done: bool | None = None
    extra: dict = field(default_factory=dict)  # unknown fields, kept so rewriting loses nothing

    def block_tokens(self, block_size: int) -> list[int]:
        """Tokens in each block of the prompt: all `block_size` but the last, which may be partial."""
        n = len(self.hash_ids)
        sizes = [block_size] * n
        if n:
            sizes[-1] = self.input_length - block_size * (n - 1)
        return sizes


@dataclass(slots=True)
class TraceMeta:
    """The optional first line of a trace file."""

    block_size: int = DEFAULT_BLOCK_SIZE
    source: str | None = None
    license: str | None = None
    notes: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class Trace:
    """A list of calls in file order plus the metadata line."""

    meta: TraceMeta
    calls: list[Call]
    path: str | None = None

    @property
    def block_size(self) -> int:
        return self.meta.block_size

    def workflows(self) -> dict[str, list[Call]]:
        """Calls grouped by workflow, in order of first appearance, each list in step order."""
        out: dict[str, list[Call]] = {}
        for c in self.calls:
            out.setdefault(c.workflow_id, []).append(c)
        for calls in out.values():
            calls.sort(key=lambda c: c.step)
        return out

    def agents(self) -> list[str]:
        """Distinct agents in order of first appearance."""
        return list(dict.fromkeys(c.agent for c in self.calls))


def arrival_times(workflows: list[list[Call]]) -> list[float]:
    """Each workflow's open-loop arrival (`t` of its first call; None counts as the earliest),
    in seconds after the earliest one. Replays run their clock from the first arrival: a float
    clock at epoch-sized `t` (ns stamps read as ms: 1.7e15 s) cannot resolve a millisecond."""
    first = min((calls[0].t for calls in workflows if calls[0].t is not None), default=0.0)
    return [0.0 if calls[0].t is None else calls[0].t - first for calls in workflows]
