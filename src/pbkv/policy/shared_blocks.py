"""Shared blocks: which prompt blocks more than one workflow sent (a framework's preamble, a
system prompt, a tool list every conversation starts with).

Hash ids are chained, so a block two workflows both sent heads the same prompt prefix in both:
it is the start every call of the framework makes, not one agent's output another agent reads.
`Staleness` learns which agents read an agent's cache from blocks a call sends again; a shared
block would make every agent a reader of whichever agent called first (dialogue: every
specialist "read" the router's cache), so those blocks are not evidence (issue 11).

Learned from the prompts alone. Memory is bounded: blocks of active workflows are held until the
workflow ends, then the most recent `memory` blocks of ended workflows, so a preamble sent by a
workflow that ended before the next one started is still recognised; at most `memory` shared
blocks are held, the least recently sent forgotten first.

Invariant: `is_shared(b)` is true only after two different workflows sent b (one of them
possibly ended and remembered); a block forgotten counts as sent by no workflow.
"""

from __future__ import annotations

from collections import OrderedDict

MEMORY = 1 << 17      # blocks (of 16 tokens: about 2M prompt tokens) per table


class SharedBlocks:
    def __init__(self, memory: int = MEMORY):
        self.memory = memory
        self.owner: dict[int, int] = {}                    # block -> the one active workflow that sent it
        self.ended: OrderedDict[int, None] = OrderedDict()  # blocks of ended workflows, oldest first
        self.shared: OrderedDict[int, None] = OrderedDict()  # blocks two workflows sent, least recent first

    def sent(self, workflow: int, block: int) -> bool:
        """`workflow` sent `block` for the first time (the caller remembers its own blocks).
        True when this made the block shared (the caller may take back what it learned from it)."""
        if block in self.shared:
            self.shared.move_to_end(block)
            return False
        owner = self.owner.get(block)
        if owner is None and block not in self.ended:
            self.owner[block] = workflow
            return False
        if owner == workflow:
            return False
        self.owner.pop(block, None)
        self.ended.pop(block, None)
        self.shared[block] = None
        if len(self.shared) > self.memory:
            self.shared.popitem(last=False)
        return True

    def end(self, workflow: int, blocks) -> None:
        """`workflow` ended; `blocks` are all it sent."""
        for b in blocks:
            if self.owner.get(b) == workflow:
                del self.owner[b]
                self.ended[b] = None
        while len(self.ended) > self.memory:
            self.ended.popitem(last=False)

    def is_shared(self, block: int) -> bool:
        return block in self.shared
