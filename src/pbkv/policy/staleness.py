"""Staleness: how likely a workflow reads again cache that its later calls passed over.

Learned online from the calls' prompts, independent of what the cache held. Each active
workflow remembers every prompt block it sent, with the call that last sent it (its *sender*).
After a later call u of the workflow, a block that no call since its sender sent again is in
*state* (a, c): a = calls of the sender's agent among them (the agent's calls that passed it
over), c = all of them (the workflow's calls since). When a later call sends the block again
(hash ids are chained: its whole prefix was sent again too), each state the block went through
gets one "visit" and one "read"; when the workflow ends, each state a remembered block went
through gets one "visit". Samples are kept per key = (agent, whether the block was sent once
or more), with a and c pooled in log-sized buckets (0, 1, 2, 3, 4-7, 8-15, 16-31, 32+):

    Q_k(a, c) = (reads_k(a, c) + 1) / (visits_k(a, c) + 1)

is the probability that such a block, in that state, is read again (one pseudo-read keeps a
state with no samples from being called dead on no evidence). In state (0, 0) (no call since
its sender) there is no evidence about the block itself: 1 (whether the workflow calls the
agent again is the predictor's business).

Why (issue 11, real traces): the agent predictions say *which agent* a workflow calls next, not
*which of that agent's cache* the call reads. ChatDev's Programmer keeps one conversation per
phase: a conversation a Programmer call passed over is rarely read again, while one every
Programmer call extends is live; and a conversation of a phase that ended is dead although
its agent was not called since (a = 0, c large), while the live one alternates with its
partner's calls (a = 0, c = 1). In a tool-calling conversation (tau-bench, BFCL) a prompt tail
that the next call re-rendered is dead. Agent-level predictions rank all of these alike; the
state tells them apart. Both counts are needed: the agent's own calls keep a conversation
alive while other agents run (hover: the retriever's, over a summarizer and a verifier call),
the workflow's calls catch a phase that ended. Sent once vs more: a block already read again
is a conversation's history, read again more often than a one-off.
"""

from __future__ import annotations

from collections import Counter

BUCKETS = 8                       # per count: 0, 1, 2, 3, 4-7, 8-15, 16-31, 32+


def bucket(x: int) -> int:
    """0..3 as they are, then one bucket per doubling, the last pooling 32 and more."""
    return x if x < 4 else min(x.bit_length() + 1, BUCKETS - 1)


class Staleness:
    """Per key: visits and reads by state; per workflow: its calls' agents and its blocks."""

    def __init__(self):
        # workflow -> block -> (its sender: index of the call, its agent's calls so far; key)
        self.blocks: dict[int, dict[int, tuple[int, int, tuple]]] = {}
        self.seq: dict[int, list[str]] = {}                   # workflow -> agent of each call
        self.agent_calls: dict[int, dict[str, int]] = {}       # workflow -> agent -> calls so far
        # key: (agent, 1 if the workflow sent the block once so far, else 2)
        self.visits: dict[tuple, list[int]] = {}   # key -> samples by state a * BUCKETS + c
        self.reads: dict[tuple, list[int]] = {}    # key -> read samples by state
        self._tables: dict[tuple, list[float]] = {}  # key -> Q by state (rebuilt after new samples)

    def call(self, workflow: int, agent: str, blocks) -> None:
        """A call of `workflow` by `agent` arrived with these prompt blocks (cached or not)."""
        self._count(workflow, agent)
        self.add(workflow, agent, blocks)

    def _count(self, workflow: int, agent: str) -> None:
        self.seq.setdefault(workflow, []).append(agent)
        counts = self.agent_calls.setdefault(workflow, {})
        counts[agent] = counts.get(agent, 0) + 1

    def add(self, workflow: int, agent: str, blocks) -> None:
        """Record blocks sent by the workflow's latest call (of `agent`; a second look at the same
        call, e.g. its full prompt path once inserted, counts each block once)."""
        if not self.seq.get(workflow):
            self._count(workflow, agent)         # blocks before any call: count one
        seq, counts = self.seq[workflow], self.agent_calls[workflow]
        now = len(seq) - 1
        seen = self.blocks.setdefault(workflow, {})
        once, again, then = (agent, 1), (agent, 2), counts[agent]
        read = Counter()
        for b in blocks:
            last = seen.get(b)
            if last is None:
                seen[b] = (now, then, once)
            elif last[0] != now:                 # not this call's own block: read again
                read[last[0], last[2]] += 1
                seen[b] = (now, then, again)
        for (sender, key), n in read.items():
            self._walk(seq, sender, now - 1, key, n, read=True)

    def end(self, workflow: int) -> None:
        """The workflow ended: every block it still remembers was never read again."""
        seq = self.seq.pop(workflow, [])
        self.agent_calls.pop(workflow, None)
        never = Counter((sender, key) for sender, _, key in self.blocks.pop(workflow, {}).values())
        for (sender, key), n in never.items():
            self._walk(seq, sender, len(seq) - 1, key, n, read=False)

    def live(self, workflow: int, block: int) -> float:
        """Q for the workflow's cache starting at `block`; 1.0 when the workflow never sent it
        or made no call since."""
        last = self.blocks.get(workflow, {}).get(block)
        if last is None:
            return 1.0
        sender, then, key = last
        since = len(self.seq[workflow]) - 1 - sender
        if since <= 0:
            return 1.0
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._build(key)
        passed = self.agent_calls[workflow][key[0]] - then
        return table[bucket(passed) * BUCKETS + bucket(since)]

    def _walk(self, seq: list[str], sender: int, last: int, key: tuple, n: int, read: bool) -> None:
        """Count the states that `n` blocks of `key`, sent by call `sender`, went through after
        calls sender+1 .. last (state (0, 0) is never looked up: not counted)."""
        visits, reads = self._row(self.visits, key), self._row(self.reads, key)
        agent, passed = key[0], 0
        for u in range(sender + 1, last + 1):
            passed += seq[u] == agent
            state = bucket(passed) * BUCKETS + bucket(u - sender)
            visits[state] += n
            if read:
                reads[state] += n
        self._tables.pop(key, None)

    @staticmethod
    def _row(table: dict[tuple, list[int]], key: tuple) -> list[int]:
        row = table.get(key)
        if row is None:
            row = table[key] = [0] * (BUCKETS * BUCKETS)
        return row

    def _build(self, key: tuple) -> list[float]:
        """Q by state, for every state (a state never visited: 1)."""
        visits, reads = self._row(self.visits, key), self._row(self.reads, key)
        return [(r + 1) / (v + 1) for r, v in zip(reads, visits)]
