"""SLRU (segmented LRU): a probation segment for nodes used once, a protected one for the rest.

Source: SGLang's `--radix-eviction-policy slru` (`python/sglang/srt/mem_cache/evict_policy.py`),
the classic segmented LRU (Karedla, Love and Wherry, 1994). A node's first access (the call that
inserted it) puts it in probation; its second access (a hit: a later call's prompt matched it)
moves it to protected. Every probation node is evicted before any protected one, LRU within a
segment, at every tier; evicted nodes go one tier down (HiCache-style write-back).

Simplified: as in SGLang's radix-cache version, the protected segment has no size cap (the
classic SLRU demotes protected overflow back to probation); accesses are counted per call
(`access.py`), not per token.
"""

from __future__ import annotations

from pbkv.cache import Node
from pbkv.policy import access
from pbkv.policy.base import CallEvent, Policy

PROTECT_AT = 2  # accesses that move a node to the protected segment


class SLRUPolicy(Policy):
    name = "slru"

    def priority(self, node: Node) -> tuple:
        return (1 if access.count(node) >= PROTECT_AT else 0, node.last_access)

    def on_call_start(self, event: CallEvent) -> None:
        hash_ids = event.call.hash_ids if event.call is not None else None
        for node in access.on_hit(self.cache.tree, event.node, hash_ids):
            self.cache.refresh(node)  # a locked node is re-ranked when unlocked; others now

    def on_call_end(self, event: CallEvent) -> None:
        access.on_insert(self.cache.tree, event.node)
