"""Staleness: how likely the next call that reads an agent's cache reads a given block of it.

Learned online from the calls' prompts, independent of what the cache held. Each active
workflow remembers every prompt block it sent, with the call that last sent it (its *sender*).
When a later call u of the workflow arrives, a block that no call since its sender sent again is
in *state* (a, c): a = calls of the sender's agent since the sender (the agent's calls that
passed it over), c = all calls since. Call u is a *chance* for the block when u's agent reads
the sender's agent's cache (the agent itself, or a *reader* of it: an agent whose call sent again
a block that the agent's call was the first of the workflow to send); it is a *read* when u
sends the block again (hash ids are chained: its whole prefix was sent again too). Samples are
kept per key = (agent, whether the block was sent once or more), with a and c pooled in
log-sized buckets (0, 1, 2, 3, 4-7, 8-15, 16-31, 32+):

    Q_k(a, c) = (reads_k(a, c) + 1) / (chances_k(a, c) + 1)

is the probability that a call reading the agent's cache reads such a block, in that state (one
pseudo-read keeps a state with no samples from being called dead on no evidence). In state
(0, 0) (no call since its sender) there is no evidence about the block itself: 1. Whether such
a call comes at all is the predictor's business: `NextUse` scales each predicted call's chance
by Q in the state the block will be in at that call (`state` gives it now).

Why (issue 11, real traces): the agent predictions say *which agent* a workflow calls next, not
*which of that agent's cache* the call reads. ChatDev's Programmer keeps one conversation per
phase: a conversation a Programmer call passed over is rarely read again, while one every
Programmer call extends is live; and a conversation of a phase that ended is not read by the
calls of the agents that read it (a = 0, c large), while the live one is read at its partner's
next call (a = 0, c = 1). In a tool-calling conversation (tau-bench, BFCL) a prompt tail that
the next call re-rendered is dead. Agent-level predictions rank all of these alike; the state
tells them apart. Both counts are needed: the agent's own calls keep a conversation alive while
other agents run (hover: the retriever's, over a summarizer and a verifier call), the
workflow's calls catch a phase that ended. Sent once vs more: a block already read again is a
conversation's history, read again more often than a one-off.

Why readers by the block's first sender, not its latest: every agent's prompt starts with the
framework's shared preamble, so each call sends again blocks the previous call (of any agent)
sent; by the latest sender every agent read every other's cache (dialogue: the router "read"
the specialists' conversations), and the calls of agents that never read a cache counted as
chances for it. For the same reason a block another workflow sent too (the preamble itself:
`shared_blocks.py`) names no reader: the first sender of a workflow's preamble is whichever agent
called first (dialogue: the router), and every later call sends it again. `NextUse` reads the
same readers (issue 11: one rule, learned from the prompts alone; it had a twin learned from the
cached paths calls arrived on, which depended on what the cache held and grew the same way).

Why per reader call, not "ever read again" (the previous rule, which counted a state as visited
when the block was read, or when its workflow ended): (1) evidence comes at every call, not at
the end of a workflow: with 16 long ChatDev workflows running at once, no "never read" sample
came until the first one ended, so for most of a replay every state looked live; (2) "ever read"
pools whether the agent is called again with whether its call reads the block, and the first
is what the predictor knows per workflow (swe's reviewer: its blocks are read whenever it is
called; hover's summarizer after the verifier). Measured in docs/benchmarks.md, "Staleness".
"""

from __future__ import annotations

from collections import Counter

from pbkv.policy.readers import Readers
from pbkv.policy.shared_blocks import SharedBlocks

BUCKETS = 8                       # per count: 0, 1, 2, 3, 4-7, 8-15, 16-31, 32+


def bucket(x: int) -> int:
    """0..3 as they are, then one bucket per doubling, the last pooling 32 and more."""
    return x if x < 4 else min(x.bit_length() + 1, BUCKETS - 1)


class Staleness:
    """Per key: chances and reads by state; per workflow: its calls' agents and its blocks, the
    blocks grouped by sender (a group: (sender call index, its agent's calls then, key))."""

    def __init__(self):
        self.blocks: dict[int, dict[int, tuple]] = {}    # workflow -> block -> its group
        self.groups: dict[int, Counter] = {}             # workflow -> group -> blocks not sent since
        self.sent: dict[int, Counter] = {}               # workflow -> group -> blocks its latest call resent
        self.seq: dict[int, list[str]] = {}              # workflow -> agent of each call
        self.agent_calls: dict[int, dict[str, int]] = {}  # workflow -> agent -> calls so far
        self.readers = Readers()                         # agent -> others sending again blocks it sent first
        self.origin: dict[int, dict[int, str]] = {}      # workflow -> block -> agent of its first sender
        self.shared = SharedBlocks()                     # blocks other workflows sent too: not evidence of reading
        self.chances: dict[tuple, list[int]] = {}        # key -> samples by state a * BUCKETS + c
        self.reads: dict[tuple, list[int]] = {}          # key -> read samples by state
        self._tables: dict[tuple, list[float]] = {}      # key -> Q by state (rebuilt after new samples)

    def call(self, workflow: int, agent: str, blocks) -> None:
        """A call of `workflow` by `agent` arrived with these prompt blocks (cached or not)."""
        self._count(workflow, agent)
        self.add(workflow, agent, blocks)

    def _count(self, workflow: int, agent: str) -> None:
        if self.seq.get(workflow):
            self._close(workflow)                # the previous call's blocks are all known now
        self.seq.setdefault(workflow, []).append(agent)
        counts = self.agent_calls.setdefault(workflow, {})
        counts[agent] = counts.get(agent, 0) + 1

    def add(self, workflow: int, agent: str, blocks) -> None:
        """Record blocks sent by the workflow's latest call (of `agent`; a second look at the same
        call, e.g. its full prompt path once inserted, counts each block once)."""
        if not self.seq.get(workflow):
            self._count(workflow, agent)         # blocks before any call: count one
        now = len(self.seq[workflow]) - 1
        then = self.agent_calls[workflow][agent]
        once, again = (now, then, (agent, 1)), (now, then, (agent, 2))
        seen = self.blocks.setdefault(workflow, {})
        origin = self.origin.setdefault(workflow, {})
        shared, readers = self.shared, self.readers
        new, resent = 0, Counter()               # blocks first sent now; sent again, by previous group
        for b in blocks:
            last = seen.get(b)
            if last is None:
                seen[b] = once
                new += 1
                origin[b] = agent
                if shared.sent(workflow, b):
                    readers.shared(b)            # it evidenced no reading: take it back
            elif last[0] != now:                 # not this call's own block: read again
                first = origin[b]
                if first != agent and not shared.is_shared(b):
                    readers.read(b, first, agent)
                resent[last] += 1
                seen[b] = again
        self._regroup(workflow, once, new, again, resent)

    def _regroup(self, workflow: int, once: tuple, new: int, again: tuple, resent: Counter) -> None:
        """Move the group counts `add` gathered: `new` blocks into `once`, the `resent` ones
        from their previous groups into `again` (counted once per call, not per block: nothing
        reads the groups until the call is closed)."""
        groups = self.groups.setdefault(workflow, Counter())
        sent = self.sent.setdefault(workflow, Counter())
        if new:
            groups[once] += new
        for last, n in resent.items():
            groups[last] -= n
            if not groups[last]:
                del groups[last]
            sent[last] += n
        if resent:
            groups[again] += sum(resent.values())

    def _close(self, workflow: int) -> None:
        """The workflow's latest call u is complete: count it as a chance for every group of
        blocks whose agent's cache u's agent reads, and as a read for those it sent again."""
        seq, counts = self.seq[workflow], self.agent_calls[workflow]
        u = len(seq) - 1
        caller = seq[u]
        sent = self.sent.pop(workflow, Counter())
        groups = self.groups.get(workflow, {})
        for group in set(groups) | set(sent):
            sender, then, key = group
            since = u - 1 - sender
            agent = key[0]
            if since <= 0 or (caller != agent and caller not in self.readers.of(agent)):
                continue
            read = sent.get(group, 0)
            n = groups.get(group, 0) + read
            passed = counts[agent] - (caller == agent) - then
            state = bucket(passed) * BUCKETS + bucket(since)
            self._row(self.chances, key)[state] += n
            self._row(self.reads, key)[state] += read
            self._tables.pop(key, None)

    def end(self, workflow: int) -> None:
        """The workflow ended: count its last call, forget its blocks."""
        if self.seq.get(workflow):
            self._close(workflow)
        self.shared.end(workflow, self.blocks.get(workflow, ()))
        for table in (self.seq, self.agent_calls, self.blocks, self.groups, self.sent, self.origin):
            table.pop(workflow, None)

    def live(self, workflow: int, block: int) -> float:
        """Q for the workflow's cache starting at `block`; 1.0 when the workflow never sent it
        or made no call since."""
        found = self.state(workflow, block)
        if found is None:
            return 1.0
        key, passed, since = found
        return self.table(key)[bucket(passed) * BUCKETS + bucket(since)]

    def state(self, workflow: int, block: int) -> tuple | None:
        """(key, a, c) of the workflow's block now: the next call of the workflow is a chance in
        state (a + its agent's calls before it, c + calls before it); None when the workflow
        never sent the block or made no call since (no evidence about it)."""
        last = self.blocks.get(workflow, {}).get(block)
        if last is None:
            return None
        sender, then, key = last
        since = len(self.seq[workflow]) - 1 - sender
        if since <= 0:
            return None
        return key, self.agent_calls[workflow][key[0]] - then, since

    def table(self, key: tuple) -> list[float]:
        """Q by state (index a_bucket * BUCKETS + c_bucket) for `key`."""
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._build(key)
        return table

    @staticmethod
    def _row(table: dict[tuple, list[int]], key: tuple) -> list[int]:
        row = table.get(key)
        if row is None:
            row = table[key] = [0] * (BUCKETS * BUCKETS)
        return row

    def _build(self, key: tuple) -> list[float]:
        """Q by state, for every state (a state with no chances: 1)."""
        chances, reads = self._row(self.chances, key), self._row(self.reads, key)
        return [(r + 1) / (n + 1) for r, n in zip(reads, chances)]
