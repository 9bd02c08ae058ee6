"""The connector's shared tier: KV blocks in a directory every vLLM instance of the same model reads
and writes, keyed by vLLM's own chained block hashes. Imports no vLLM (unit-tested in the main venv).

When vLLM's keys are stable across processes (vllm 0.32, `vllm/v1/core/kv_cache_utils.py`): a
block's hash is `hash_fn((parent hash, the block's token ids, extra keys))`, and the first
block's parent is `NONE_HASH`, which `init_none_hash` sets to `hash_fn(PYTHONHASHSEED)` when that
variable is set and to 32 random bytes (`os.urandom`) otherwise. So keys agree between instances
(and survive restarts) only when
- every instance runs with the same `PYTHONHASHSEED` (any value; it reaches vLLM's engine-core
  process through the environment), and
- every instance uses the same `prefix_caching_hash_algo`; the shared tier accepts only the
  sha256 ones ("sha256": sha256 over a pickle, "sha256_cbor": sha256 over CBOR). The xxhash ones
  are not collision-resistant: a collision would serve another prompt's KV to a different
  instance, so they are refused here.
Otherwise `key_problem` says why and the connector refuses `shared_dir` at start.

A file's key is sha256 of the instance identity (model, revision, dtype, KV-cache dtype, block
size, hash algorithm, tensor-parallel rank and size: each rank stores its own shard) and the
block's full hash bytes (`pbkv.engine.shared_kv.SharedKVDir`: atomic writes, sha256-checked
reads, LRU byte bound).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from pbkv.engine.kvfile import CorruptKV
from pbkv.engine.shared_kv import SharedKVDir

STABLE_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_SHARED_BYTES = 8 << 30


def key_problem(hash_algo: str, env: Mapping[str, str]) -> str | None:
    """Why vLLM's block hashes would differ between instances (None: they agree; see above)."""
    if env.get("PYTHONHASHSEED") is None:
        return ("PYTHONHASHSEED is not set: vLLM seeds every block hash chain with 32 random bytes per "
                "process, so no two instances (or restarts) share a key. Start every instance with the same "
                "PYTHONHASHSEED (e.g. PYTHONHASHSEED=0)")
    if hash_algo not in STABLE_ALGOS:
        return (f"prefix_caching_hash_algo {hash_algo!r} is not collision-resistant across instances: use "
                f"{' or '.join(STABLE_ALGOS)} (--prefix-caching-hash-algo)")
    return None


def instance_identity(model: str, revision: str | None, dtype, cache_dtype, block_size: int, hash_algo: str,
                      rank: int, world: int) -> str:
    """What must match for two instances' blocks (of one rank) to be interchangeable."""
    return (f"vllm|{model}@{revision or '-'}|{dtype}|kv {cache_dtype}|bs {block_size}|{hash_algo}"
            f"|rank {rank}/{world}")


def hash_int(block_hash) -> int:
    """vLLM's full block hash (bytes) as the int `SharedKVDir` keys by (all bits kept)."""
    return int.from_bytes(bytes(block_hash), "big")


class SharedBlocks:
    """The shared directory seen by one process: one `SharedKVDir` per tensor-parallel rank (the
    scheduler checks every rank's file; a worker reads and writes its own rank's)."""

    def __init__(self, directory: str | Path, identities: Sequence[str], max_bytes: int | None = None):
        self.dirs = [SharedKVDir(directory, ident, max_bytes or DEFAULT_SHARED_BYTES) for ident in identities]

    def prefix(self, hashes: Sequence) -> int:
        """How many leading blocks every rank holds (chained: stop at the first miss)."""
        n = 0
        for h in hashes:
            if not all(d.contains(hash_int(h)) for d in self.dirs):
                break
            n += 1
        return n

    def get(self, block_hash, rank_index: int = 0) -> torch.Tensor | None:
        """One rank's block, verified; None if missing or bad (a bad file is removed)."""
        try:
            return self.dirs[rank_index].get(hash_int(block_hash))
        except CorruptKV:
            return None

    def put(self, block_hash, kv: torch.Tensor, rank_index: int = 0) -> bool:
        """Store one rank's block (False: it was there already, or the write failed)."""
        try:
            return self.dirs[rank_index].put(hash_int(block_hash), kv)
        except (OSError, RuntimeError, ValueError):
            return False
