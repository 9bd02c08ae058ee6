"""Staleness: how likely a workflow reads again cache that its agent's later calls passed over.

Learned online from the calls' prompts, independent of what the cache held. Each active
workflow remembers every prompt block it sent, with the agent of the last call that sent it.
A block's *gap* g is the number of calls of that agent, in the same workflow, that came after
it and did not send it. When a later call of the workflow sends the block again (hash ids are
chained: its whole prefix was sent again too) after g such calls, that is one "read at gap g"
sample; when the workflow ends, each remembered block is one "never read" sample at its
final gap c. Samples are kept per key = (agent, whether the block was sent once or more):

    Q_k(g) = (R_k(d >= g) + 1) / (R_k(d >= g) + N_k(c >= g) + 1)      for g >= 1

is the probability that such a block, passed over by g calls of its agent, is read again
(R: read samples, N: never; one pseudo-read keeps a key with no samples, or a gap never seen
closing, from being called dead on no evidence). At g = 0 there is no evidence about the block
itself: 1 (whether the agent is called again is the predictor's business).

Why (issue 11, real traces): the agent predictions say *which agent* a workflow calls next, not
*which of that agent's cache* the call reads. ChatDev's Programmer keeps one conversation per
phase: a conversation a Programmer call passed over is rarely read again, while one every
Programmer call extends is live. In a tool-calling conversation (tau-bench, BFCL) a prompt tail
that the next call re-rendered is dead. Agent-level predictions rank both alike; this tells
them apart. Counting only the agent's own calls keeps a conversation alive while other agents
run (hover: the retriever's, over a summarizer and a verifier call). Sent once vs more: a
block already read again is a conversation's history, read again more often than a one-off.
"""

from __future__ import annotations

MAX_GAP = 32   # gaps above this are pooled


class Staleness:
    """Per key: read and never-read samples by gap; per workflow: its blocks and agent calls."""

    def __init__(self):
        self.blocks: dict[int, dict[int, tuple[int, tuple]]] = {}  # workflow -> block -> (agent calls then, key)
        self.agent_calls: dict[int, dict[str, int]] = {}           # workflow -> agent -> calls so far
        # key: (agent, 1 if the workflow sent the block once so far, else 2)
        self.reads: dict[tuple, list[int]] = {}   # key -> read samples by gap (MAX_GAP+1 pooled)
        self.never: dict[tuple, list[int]] = {}   # key -> never-read blocks by final gap
        self._tables: dict[tuple, list[float]] = {}  # key -> Q by gap (rebuilt after new samples)

    def call(self, workflow: int, agent: str, blocks) -> None:
        """A call of `workflow` by `agent` arrived with these prompt blocks (cached or not)."""
        counts = self.agent_calls.setdefault(workflow, {})
        counts[agent] = counts.get(agent, 0) + 1
        self.add(workflow, agent, blocks)

    def add(self, workflow: int, agent: str, blocks) -> None:
        """Record blocks sent by the workflow's latest call of `agent` (a second look at the same
        call, e.g. its full prompt path once inserted, counts each block once)."""
        counts = self.agent_calls.setdefault(workflow, {})
        now = counts.setdefault(agent, 1)
        seen = self.blocks.setdefault(workflow, {})
        once, again = (agent, 1), (agent, 2)
        for b in blocks:
            last = seen.get(b)
            if last is None:
                seen[b] = (now, once)
                continue
            then, key = last
            if key[0] == agent and then == now:
                continue                     # this call sent it already
            gap = counts.get(key[0], 0) - then - (key[0] == agent)   # this call read it: not passed over
            self._row(self.reads, key)[min(gap, MAX_GAP + 1)] += 1
            self._tables.pop(key, None)
            seen[b] = (now, again)

    def end(self, workflow: int) -> None:
        """The workflow ended: every block it still remembers was never read again."""
        counts = self.agent_calls.pop(workflow, {})
        for then, key in self.blocks.pop(workflow, {}).values():
            self._row(self.never, key)[min(counts.get(key[0], 0) - then, MAX_GAP + 1)] += 1
            self._tables.pop(key, None)

    def live(self, workflow: int, block: int) -> float:
        """Q for the workflow's cache starting at `block`; 1.0 when the workflow never sent it
        or no call of its agent passed over it yet."""
        last = self.blocks.get(workflow, {}).get(block)
        if last is None:
            return 1.0
        then, key = last
        gap = min(self.agent_calls[workflow].get(key[0], 0) - then, MAX_GAP + 1)
        if gap <= 0:
            return 1.0
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._build(key)
        return table[gap]

    @staticmethod
    def _row(table: dict[tuple, list[int]], key: tuple) -> list[int]:
        row = table.get(key)
        if row is None:
            row = table[key] = [0] * (MAX_GAP + 2)
        return row

    def _build(self, key: tuple) -> list[float]:
        """Q(g) for g = 0 .. MAX_GAP + 1 (the pooled gap takes the pooled samples)."""
        reads, never = self._row(self.reads, key), self._row(self.never, key)
        table = [0.0] * (MAX_GAP + 2)
        r = n = 0                                   # samples at gaps >= g
        for g in range(MAX_GAP + 1, -1, -1):
            r, n = r + reads[g], n + never[g]
            table[g] = (r + 1) / (r + n + 1)
        return table
