"""What a Ray Serve LLM replica reports as `routing_stats`: the prompts it served. No Ray here.

A vLLM replica cannot cheaply list the blocks its prefix cache holds (and vLLM's block hashes
are seeded per process, so a router could not recompute them), so the replica reports the
`TextChunks` ids of the prompts it recently served, most recent last, bounded by `max_blocks`
(least recently served dropped first: roughly what an LRU prefix cache of that many chunks
keeps), plus per workflow its latest prompt + output token estimate (bounded by
`max_workflows`, least recently used dropped; a workflow that ended is dropped at once), and
its load (calls running). This is an approximation of the replica's cache: size `max_blocks`
to what the replica's KV tiers hold (`pbkv.scale.llm` derives it from the connector's tiers).

Invariants: `len(blocks) <= max_blocks`, `len(workflows) <= max_workflows`, `running >= 0`,
every `stats()` has a new `seq` (the router's `Overlay` replaces its memory on a new `seq`).
"""

from __future__ import annotations

from collections import OrderedDict

from pbkv.route import ReplicaSnapshot
from pbkv.scale.llm_hints import LLMCall, TextChunks


class ReplicaRecord:
    def __init__(self, replica_id: str, chunks: TextChunks = TextChunks(), max_blocks: int = 100_000,
                 max_workflows: int = 10_000):
        if max_blocks < 1 or max_workflows < 1:
            raise ValueError(f"max_blocks and max_workflows must be >= 1, got {max_blocks}, {max_workflows}")
        self.id, self.chunks = replica_id, chunks
        self.max_blocks, self.max_workflows = max_blocks, max_workflows
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.workflows: OrderedDict[str, int] = OrderedDict()
        self.running = 0
        self.served = 0
        self.seq = 0

    def started(self, call: LLMCall | None) -> None:
        """A call begins on this replica (hinted or not: both count as load)."""
        self.running += 1
        if call is None:
            return
        for h in call.route.hash_ids:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        wf = call.route.workflow_id
        self.workflows[wf] = call.route.input_tokens + call.route.output_tokens
        self.workflows.move_to_end(wf)
        while len(self.workflows) > self.max_workflows:
            self.workflows.popitem(last=False)

    def finished(self, call: LLMCall | None) -> None:
        """A call ended (answered, failed or cancelled); a call that ends its workflow drops it."""
        self.running = max(0, self.running - 1)
        self.served += 1
        if call is not None and call.done:
            self.workflows.pop(call.route.workflow_id, None)

    def stats(self) -> dict:
        """`ReplicaSnapshot.to_stats()` of what this replica served, with a new `seq`."""
        self.seq += 1
        snap = ReplicaSnapshot(self.id, load=float(self.running), blocks=frozenset(self.blocks),
                               workflows=dict(self.workflows), block_size=self.chunks.block_tokens)
        return snap.to_stats() | {"seq": self.seq, "served": self.served}
