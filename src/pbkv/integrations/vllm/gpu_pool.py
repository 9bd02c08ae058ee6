"""Steering vLLM's GPU prefix cache through its block pool (no fork).

vLLM evicts its GPU prefix cache in free-queue order (LRU; blocks without a hash are reused
first) and offers no policy hook. What a connector can reach is the pool itself
(`bind_gpu_block_pool`). When pbkv's policy evicts a node from its model of the GPU cache
(retired first, then lowest reuse score), `GPUSteer.demote` moves those blocks to the head of
vLLM's free queue: `touch` takes a free block out of the queue, `evict_blocks` drops its hash,
and `free_blocks` puts a hashless block at the head (vLLM reuses those first). The block's KV
is still in pbkv's RAM tier (written at compute time), so a later request loads it back.

What this cannot do (it would need a fork): reorder vLLM's free queue by score (only "first" is
reachable: a block can be sent to the head, not ranked), protect a block from vLLM's own LRU
eviction without holding a reference (which would shrink the pool that running requests
need), or see vLLM's evictions as they happen (pbkv's tree models the GPU tier; a block vLLM
dropped early is still served from RAM). Blocks in use (reference count > 0) are left alone.
"""

from __future__ import annotations


class GPUSteer:
    def __init__(self, pool, stats, max_remembered: int = 1 << 20):
        self.pool = pool
        self.stats = stats
        self.hashes: dict[int, object] = {}   # tree key -> vLLM BlockHash
        self.max_remembered = max_remembered

    def remember(self, keys: list[int], block_hashes) -> None:
        if len(self.hashes) > self.max_remembered:
            self.hashes.clear()   # only a steering aid: forgetting costs a missed demotion
        for k, h in zip(keys, block_hashes):
            self.hashes[k] = h

    def demote(self, keys: list[int]) -> None:
        """Send the free cached blocks of `keys` to the head of vLLM's free queue."""
        blocks = []
        for k in keys:
            h = self.hashes.pop(k, None)
            if h is None:
                continue
            found = self.pool.get_cached_block(h, [0])
            if not found:
                continue
            block = found[0]
            if block.ref_cnt == 0 and not block.is_null:
                blocks.append(block)
        if not blocks:
            return
        self.pool.touch(blocks)
        self.pool.evict_blocks({b.block_id for b in blocks})
        self.pool.free_blocks(blocks)
        self.stats.gpu_demoted_blocks += len(blocks)
