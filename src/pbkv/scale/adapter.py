"""From a serving request and replicas' `routing_stats` to a pbkv router's input. No Ray here.

A replica reports `ReplicaSnapshot.to_stats()` (cached block ids, workflow token counts, load)
every few seconds; between two reports the router would be blind to what it just placed. The
`Overlay` remembers, per replica, the prompts and workflows routed there since, so a workflow's
second call finds its first one at once. A new report (its `seq` changed) replaces the overlay
of that replica, so blocks the replica evicted do not linger; the overlay is also bounded
(`max_blocks` per replica; when full it is cleared, costing routing quality until the next report).

Requests carry pbkv's hints as a dict (`workflow_id`, `agent`, `hash_ids`, `input_tokens`, and
optionally `output_tokens`, `reuse_probability`, `next_prefix`); `route_request` finds that dict
among a call's arguments and returns None for anything else (routed as plain load balancing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from pbkv.route import ReplicaSnapshot, RouteRequest


def route_request(args: Iterable, kwargs: Mapping | None = None) -> RouteRequest | None:
    """The first argument (or keyword value) that is a dict with `workflow_id` and `hash_ids`."""
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, Mapping) and "workflow_id" in value and "hash_ids" in value:
            hash_ids = tuple(int(h) for h in value["hash_ids"])
            return RouteRequest(workflow_id=str(value["workflow_id"]), agent=str(value.get("agent", "")),
                                hash_ids=hash_ids,
                                input_tokens=int(value.get("input_tokens", 16 * len(hash_ids))),
                                output_tokens=int(value.get("output_tokens", 0)),
                                reuse_probability=value.get("reuse_probability"),
                                next_prefix=tuple(int(h) for h in value.get("next_prefix", ())))
    return None


@dataclass
class Overlay:
    """What was routed to each replica since its last report (see the module docstring)."""

    max_blocks: int = 200_000
    blocks: dict[str, set[int]] = field(default_factory=dict)
    workflows: dict[str, dict[str, int]] = field(default_factory=dict)
    seen_seq: dict[str, object] = field(default_factory=dict)

    def routed(self, replica: str, request: RouteRequest) -> None:
        blocks = self.blocks.setdefault(replica, set())
        if len(blocks) + len(request.hash_ids) > self.max_blocks:
            blocks.clear()
            self.workflows.pop(replica, None)
        blocks.update(request.hash_ids)
        wf = self.workflows.setdefault(replica, {})
        wf[request.workflow_id] = max(wf.get(request.workflow_id, 0),
                                      request.input_tokens + request.output_tokens)

    def forget(self, replica: str) -> None:
        self.blocks.pop(replica, None)
        self.workflows.pop(replica, None)

    def view(self, replica: str, stats: Mapping | None, load: float | None) -> ReplicaSnapshot:
        """The replica's last report merged with what was routed there since; `load` (a fresher
        queue length, e.g. Ray's cache) replaces the reported one when known."""
        stats = dict(stats or {})
        if "seq" in stats and self.seen_seq.get(replica) != stats["seq"]:
            self.seen_seq[replica] = stats["seq"]
            self.forget(replica)
        snap = ReplicaSnapshot.from_stats(stats, replica_id=replica)
        extra = self.blocks.get(replica)
        if extra:
            snap.blocks = snap.blocks | extra
        for wf, tokens in self.workflows.get(replica, {}).items():
            snap.workflows[wf] = max(snap.workflows.get(wf, 0), tokens)
        if load is not None:
            snap.load = float(load)
        return snap
