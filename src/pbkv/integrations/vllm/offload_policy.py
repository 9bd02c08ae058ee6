"""`PBKVCachePolicy`: pbkv's eviction order for vLLM's native CPU offload tier.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000, "cache_policy": "PBKVCachePolicy",
            "cache_policy_module_path": "pbkv.integrations.vllm.offload_policy"}}'

(vLLM's offloading connector needs CUDA; on a CPU-only machine only the unit tests run.)

Order (smallest first), the lifecycle part of pbkv's reuse score:
  1. retired chunks: every workflow that used them has ended (`workflow_done` hint);
  2. then by the number of running workflows that used the chunk (a proxy for the reuse score:
     this tier sees no predictions), then least recently used.
A chunk that no hinted workflow used is ranked like an active chunk of no workflow: plain LRU
after the retired ones. Invariants: `evict` is atomic (None and no change when n chunks cannot
be chosen) and never returns a protected or pinned (ref_cnt != 0) chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from pbkv.integrations.vllm import require_vllm
from pbkv.integrations.vllm.hints import parse_hints

require_vllm()

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus  # noqa: E402


class PBKVCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict[bytes, ChunkStatus] = {}
        self.last: dict[bytes, int] = {}
        self.users: dict[bytes, set[str]] = {}       # chunk -> running workflows that used it
        self.seen: set[bytes] = set()                # chunks some hinted workflow used
        self.by_workflow: dict[str, set[bytes]] = {}
        self._tick = itertools.count(1)

    # ------------------------------------------------------------------ CachePolicy

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk) -> None:
        self.chunks[key] = chunk
        self.last[key] = next(self._tick)

    def remove(self, key) -> None:
        self.chunks.pop(key, None)
        self.last.pop(key, None)
        for wf in self.users.pop(key, ()):
            self.by_workflow.get(wf, set()).discard(key)
        self.seen.discard(key)

    def touch(self, keys: Iterable, req_context) -> None:
        hints = parse_hints(getattr(req_context, "kv_transfer_params", None))
        for key in reversed(list(keys)):   # the prefix ends most recent: it is used by every extension
            if key not in self.chunks:
                continue
            self.last[key] = next(self._tick)
            if hints.hinted:
                self.users.setdefault(key, set()).add(hints.workflow_id)
                self.by_workflow.setdefault(hints.workflow_id, set()).add(key)
                self.seen.add(key)

    def on_request_finished(self, key_groups: Sequence[Sequence], insertion_only_keys, reused_keys,
                            req_context) -> None:
        for keys in key_groups:
            self.touch(keys, req_context)
        hints = parse_hints(getattr(req_context, "kv_transfer_params", None))
        if hints.hinted and hints.done:
            self.end_workflow(hints.workflow_id)

    def end_workflow(self, workflow_id: str) -> None:
        """The workflow's chunks lose it as a user; those with no user left are retired."""
        for key in self.by_workflow.pop(workflow_id, ()):
            users = self.users.get(key)
            if users is not None:
                users.discard(workflow_id)

    def rank(self, key) -> tuple:
        users = self.users.get(key)
        retired = key in self.seen and not users
        return (0 if retired else 1, len(users or ()), self.last.get(key, 0))

    def evict(self, n: int, protected: set):
        if n == 0:
            return []
        free = [k for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected]
        if len(free) < n:
            return None
        chosen = sorted(free, key=self.rank)[:n]
        out = [(k, self.chunks[k]) for k in chosen]
        for k in chosen:
            self.remove(k)
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self.last.clear()
        self.users.clear()
        self.seen.clear()
        self.by_workflow.clear()
