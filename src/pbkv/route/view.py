"""`ReplicaSnapshot`: a plain `ReplicaView` from reported numbers (tests, Ray `routing_stats`).

A snapshot holds the set of cached block ids and the per-workflow token counts a replica last
reported, and per workflow the replica's predicted probability that the workflow calls again
(`reuse`: its policy's `reuse_probability`, when it has one). Block ids are chained, so the
cached prefix of a prompt is its longest run of leading ids that are all present; the last block
may be partial, hence `input_tokens` caps the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class ReplicaSnapshot:
    id: str
    load: float = 0.0
    blocks: frozenset[int] = frozenset()
    workflows: dict[str, int] = field(default_factory=dict)
    block_size: int = 16
    reuse: dict[str, float] = field(default_factory=dict)

    def cached_prefix_tokens(self, hash_ids: Sequence[int]) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.blocks:
                break
            n += 1
        return n * self.block_size

    def workflow_tokens(self, workflow_id: str) -> int:
        return self.workflows.get(workflow_id, 0)

    @property
    def workflow_count(self) -> int:
        return len(self.workflows)

    def reuse_probability(self, workflow_id: str) -> float | None:
        """The replica's predicted probability that the workflow calls again (None: unknown)."""
        return self.reuse.get(workflow_id)

    def to_stats(self) -> dict:
        """The JSON-friendly form a replica reports (see `from_stats`)."""
        return {"id": self.id, "load": self.load, "blocks": sorted(self.blocks),
                "workflows": dict(self.workflows), "block_size": self.block_size, "reuse": dict(self.reuse)}

    @classmethod
    def from_stats(cls, stats: dict, replica_id: str | None = None) -> "ReplicaSnapshot":
        return cls(id=replica_id if replica_id is not None else str(stats.get("id", "")),
                   load=float(stats.get("load", 0.0)), blocks=frozenset(stats.get("blocks", ())),
                   workflows={str(k): int(v) for k, v in (stats.get("workflows") or {}).items()},
                   block_size=int(stats.get("block_size", 16)),
                   reuse={str(k): float(v) for k, v in (stats.get("reuse") or {}).items()})
