"""Readers: which agents read an agent's cache, learned from the blocks calls send again.

Agent r is a reader of agent a when a call of r sent again a block that a call of a was the
first of its workflow to send (hash ids are chained: r's prompt carried a's whole prefix). Each
such edge (a, r) is held while a block evidences it. A block that later turns out to be shared
(another workflow sent it too, `shared_blocks.py`: the framework's preamble) is no evidence,
and an edge only such blocks evidenced is taken back. Why: a block is known shared only once a
second workflow sends it; a server running one workflow at a time learned, from its first
workflow's preamble, that every agent read whichever agent called first, and kept it for good.

Memory is bounded: the latest `memory` blocks that evidenced an edge are remembered; an edge a
forgotten block evidenced is kept (it can no longer be taken back).

Invariants: `of(a)` holds r exactly when some block evidenced (a, r) and not every such block
turned out shared; `version` changes whenever some `of(a)` changes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from pbkv.policy.shared_blocks import MEMORY

NONE: frozenset[str] = frozenset()


class Readers:
    def __init__(self, memory: int = MEMORY):
        self.memory = memory
        self.by_agent: dict[str, set[str]] = {}                    # a -> its readers
        self.count: Counter = Counter()                            # (a, r) -> blocks evidencing it
        self.evidence: OrderedDict[int, set[tuple]] = OrderedDict()  # block -> edges it evidences, oldest first
        self.version = 0

    def of(self, agent: str):
        return self.by_agent.get(agent, NONE)

    def read(self, block: int, first: str, reader: str) -> None:
        """A call of `reader` sent again `block`, first sent in its workflow by a call of `first`."""
        edge = (first, reader)
        edges = self.evidence.get(block)
        if edges is None:
            edges = self.evidence[block] = set()
            if len(self.evidence) > self.memory:
                self.evidence.popitem(last=False)    # its edges keep its count: never taken back
        elif edge in edges:
            return
        edges.add(edge)
        self.count[edge] += 1
        if self.count[edge] == 1:
            self.by_agent.setdefault(first, set()).add(reader)
            self.version += 1

    def shared(self, block: int) -> None:
        """`block` turned out shared: take back what it evidenced."""
        for edge in self.evidence.pop(block, ()):
            self.count[edge] -= 1
            if self.count[edge]:
                continue
            del self.count[edge]
            first, reader = edge
            agents = self.by_agent[first]
            agents.discard(reader)
            if not agents:
                del self.by_agent[first]
            self.version += 1
