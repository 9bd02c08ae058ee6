"""KV moved between two live engines (Ray replicas) on a router's decision.

When a router sends a call to replica B but replica A caches a longer prefix of its prompt, and
moving those tokens beats recomputing them (`pbkv.route`, `fetch_from`), B asks A for them
before it queues the call (`pbkv.scale.replica`):
- B: `fetch_start` (engine thread) says from which block (where the prefix B holds ends) and
  whether at all (not when B's load rule would recompute that many tokens anyway);
- A: `export_prefix` (engine thread) reads the longest leading run of the keys that its tree
  holds, in any tier, whole blocks only, and hands over a CPU copy (the node's data stays);
- B: `PeerInbox.put` (engine thread) keeps the blocks by key until a call's admission reads
  them, right after its local prefix and before the shared directory (`shared.py`), exactly as
  a shared-directory read: the tokens count as "shared" hits (KV from outside this engine).

Keys are the chained block hashes every replica computes alike (`tokens.block_hashes`), so a key
names the whole prefix up to its block, and the replicas of one deployment serve one model.

Invariants: the inbox holds at most `max_bytes` of KV (the oldest blocks go first); a block is
read at most once (the call that reads it stores it in the tree, like any prefill); an export
never changes the exporter's cache (no tier moves, no recency).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from pbkv.cache import Tier
from pbkv.engine.base import tokens_by_tier
from pbkv.engine.hf.disk import CorruptKV

DEFAULT_INBOX_BYTES = 1 << 30   # 1 GiB of fetched KV waiting for its call


@dataclass
class PeerCounters:
    blocks_received: int = 0     # blocks put in the inbox
    blocks_read: int = 0         # of those, read by a call's admission
    blocks_sent: int = 0         # blocks exported to another engine
    blocks_unused: int = 0       # dropped from the inbox unread (bound or replaced)


class PeerInbox:
    """Blocks fetched from another engine for calls about to run here (module docstring)."""

    def __init__(self, block_size: int, device: torch.device, max_bytes: int = DEFAULT_INBOX_BYTES):
        self.block_size, self.device, self.max_bytes = block_size, device, max_bytes
        self.blocks: OrderedDict[int, torch.Tensor] = OrderedDict()   # key -> KV of one block
        self.bytes = 0
        self.counters = PeerCounters()

    def put(self, keys: Sequence[int], kv: torch.Tensor) -> int:
        """(engine thread) Keep `kv` (the tokens of `len(keys)` whole blocks); returns blocks kept."""
        bs = self.block_size
        n = min(len(keys), kv.shape[3] // bs)
        for i in range(n):
            self._drop(keys[i])
            block = kv[:, :, :, i * bs:(i + 1) * bs].contiguous()
            self.blocks[keys[i]] = block
            self.bytes += _nbytes(block)
        self.counters.blocks_received += n
        while self.bytes > self.max_bytes and self.blocks:
            self._drop(next(iter(self.blocks)))
        return n

    def _drop(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is not None:
            self.bytes -= _nbytes(block)
            self.counters.blocks_unused += 1

    def has(self, key: int) -> bool:
        return key in self.blocks

    def read(self, keys: Sequence[int]) -> torch.Tensor | None:
        """(engine thread) KV of the longest leading run of `keys` held, on the model's device,
        taken out of the inbox; None if the first is not held."""
        parts = []
        for key in keys:
            block = self.blocks.pop(key, None)
            if block is None:
                break
            self.bytes -= _nbytes(block)
            parts.append(block)
        self.counters.blocks_read += len(parts)
        if not parts:
            return None
        return torch.cat(parts, dim=3).to(self.device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def held_blocks(tree, keys: Sequence[int]) -> tuple[int, list]:
    """(engine thread) (whole blocks of the prompt `keys` that `tree` holds from the start, in any
    tier; the path holding them, root side first)."""
    node, matched = tree.match(list(keys))
    if not matched:
        return 0, []
    path = node.path()
    last = path[-1]
    if matched == last.start + len(last.blocks) and last.tail_tokens < tree.block_size:
        matched -= 1                      # its last matched block is partial: not a whole block
    return matched, path


def fetch_start(engine, keys: Sequence[int], first: int) -> int | None:
    """(engine thread) The block to fetch `keys` from (where the prefix this engine holds in any
    tier ends now, at most `first`: the router's view is a report old; admission loads a host or
    disk prefix back first, then reads the inbox from its end), or None when this engine would
    not read what it fetched, by the rules admission applies: its load rule recomputes that many
    tokens rather than load them (`SharedOps.would_read_outside`: a short fetch would only be
    moved and dropped), or it would recompute the part of the prefix it holds below the device
    (`would_load`), and a call that recomputes that part computes the rest too (admission reads
    the inbox only after a prefix on the device or loaded back: seen as fetched blocks never read
    on hover with 2 `tiny` replicas, whose prefill beats a host load's fixed latency)."""
    held, path = held_blocks(engine.tree, keys)
    start = min(first, held)
    tokens = (len(keys) - start) * engine.tree.block_size
    if tokens <= 0 or not engine.would_read_outside(tokens):
        return None
    lower = tokens_by_tier([n for n in path if n.tier != Tier.DEVICE])   # what admission would load
    if sum(lower) and not engine.would_load(lower, engine.rates.prefill_seconds(sum(lower))):
        return None
    return start


def export_prefix(tree, store, keys: Sequence[int], first: int = 0) -> tuple[int, torch.Tensor | None]:
    """(engine thread) (blocks, CPU KV) of blocks `first`.. of the longest leading run of `keys`
    (a prompt's chained block hashes, from its start) that `tree` caches in any tier, whole
    blocks only; (0, None) when none. Data that proves unreadable ends the run there."""
    bs = tree.block_size
    matched, path = held_blocks(tree, keys)
    lo, hi = first * bs, matched * bs     # token range to send
    parts = []
    for n in path:
        start = n.start * bs
        if start + n.tokens <= lo:
            continue
        if start >= hi:
            break
        kv = n.value
        if kv is None or kv.lost:
            break
        try:
            data = store.read(kv) if kv.tier == Tier.DISK else kv.data
        except CorruptKV:
            break
        parts.append(data[:, :, :, max(0, lo - start):min(n.tokens, hi - start)].to("cpu", copy=True))
    tokens = sum(p.shape[3] for p in parts) // bs * bs
    if tokens <= 0:
        return 0, None
    kv = torch.cat(parts, dim=3)[:, :, :, :tokens].contiguous()
    return tokens // bs, kv
