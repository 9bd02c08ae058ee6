"""The real engine's side of the shared KV tier: a directory several engines (processes, Ray
replicas, `pbkv serve` instances) read and write (`pbkv.engine.shared_kv.SharedKVDir`).

- keys: block i of a prompt is stored under `block_hashes(prompt token ids)[i]`
  (`tokens.py`: chained and stable across processes, so a key names the whole prefix up to its
  block) and the model's identity (`identity`: name, dtype, KV geometry and fingerprints of
  the weights and of the config, so two checkpoints, two `tiny` models of different seeds, or
  one checkpoint under two RoPE settings, never share KV).
  Only full blocks are stored: a partial last block is matched by the same prompt alone, and
  the last prompt token is computed anyway;
- writes: after a prefill, the full blocks it computed go to the directory on the engine's
  worker thread (off the critical path). Written at prefill, not at eviction: another replica
  can use a prefix as soon as it was computed, while the writer still holds it locally (a
  workflow's next call routed elsewhere is the case that matters). Existing files are kept;
  errors are counted (`write_errors`), never raised; the first is logged as a warning naming
  the folder and the error (a read-only or full folder), then every 1,000th. The worker is
  FIFO and also runs host/disk loads: a load queued behind a burst of writes waits for them
  (the price of one I/O thread);
- reads: at admission, after the local tiers' longest usable prefix, the match goes on in the
  directory block by block, each file checked (sha256, key, model, shape); the run stops at the
  first missing or bad file (a bad one is removed and its tokens recomputed). Reads run on the
  engine thread, in place of the prefill compute they save (the load rule decides, with the
  measured read rate): a two-phase load like the host/disk tiers' is not built for this tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError

from pbkv.engine.hf.model import cache_to_kv
from pbkv.engine.hf.tokens import block_hashes
from pbkv.engine.kvfile import CorruptKV, worth_logging
from pbkv.engine.request import SHARED
from pbkv.engine.shared_kv import SharedKVDir, model_identity

log = logging.getLogger("pbkv.engine")
DEFAULT_SHARED_BYTES = 8 << 30   # the directory's bound when none is given (8 GiB)
FINGERPRINT_VALUES = 1024        # values sampled per weight tensor for the identity
SUM_CHUNK = 1 << 24              # values summed at a time (bounds the int64 copy the sum makes)
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# config fields that do not change the KV: where the model was loaded from, the library version
NOT_KV_CONFIG = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
                 "_attn_implementation_autoset")


def _bit_sum(t: torch.Tensor) -> int:
    """The sum of a tensor's values read as integers of their width (exact: integer arithmetic
    gives the same sum in any order, on any device). Any change to one value changes it."""
    flat = t.detach().reshape(-1)
    ints = flat.view(INT_VIEW[flat.element_size()]) if flat.element_size() in INT_VIEW else flat.view(torch.uint8)
    if ints.device.type == "cpu" and ints.dtype != torch.int64:   # numpy sums into int64 without a copy: 10x faster
        arr = ints.numpy()
        # each part's sum stays below 2^63 (2^30 values of at most 2^31 in magnitude)
        return sum(int(arr[i:i + (1 << 30)].sum(dtype=np.int64)) for i in range(0, arr.size, 1 << 30))
    # each chunk's int64 sum stays far below 2^63 (2^24 values of at most 2^32 each: < 2^56)
    return sum(int(ints[i:i + SUM_CHUNK].to(torch.int64).sum()) for i in range(0, ints.numel(), SUM_CHUNK))


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype, up to `FINGERPRINT_VALUES` evenly strided
    values and the integer sum of all of its values' bits (`_bit_sum`: a checkpoint that differs
    in one value anywhere, e.g. one embedding row, gets another fingerprint; the samples alone
    missed it). Exact bytes and integer sums: no float reductions, whose result could depend on
    thread counts. Reads every weight once (see `_bit_sum`)."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_VALUES)
        sample = flat[::step][:FINGERPRINT_VALUES].to("cpu").contiguous()
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{_bit_sum(p)}|".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def config_fingerprint(config) -> str:
    """sha256 of the model config's fields that can change the KV (rope_theta, rope scaling,
    attention settings, ...): two folders with the same weights and another RoPE base compute
    other KV. Fields in `NOT_KV_CONFIG` are left out."""
    fields = {k: v for k, v in config.to_dict().items() if k not in NOT_KV_CONFIG}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(lm) -> str:
    """What must match for two engines' KV to be interchangeable (see the module docstring). The
    name is the model folder's base name: replicas may mount one model at different paths (the
    weights' and config's fingerprints tell models apart)."""
    base = model_identity(Path(lm.name).name or lm.name, lm.dtype, lm.layers, lm.kv_heads, lm.head_dim)
    return f"{base}|{weights_fingerprint(lm.model)}|{config_fingerprint(lm.model.config)}"


@dataclass
class SharedCounters:
    blocks_written: int = 0       # files this engine wrote (existing keys are not counted)
    write_errors: int = 0
    read_seconds: float = 0.0


class SharedTier:
    """One engine's handle on the shared directory (see the module docstring)."""

    def __init__(self, directory: str | Path, lm, block_size: int, max_bytes: int | None = None,
                 clock: Callable[[], float] = time.time):
        self.dir = SharedKVDir(directory, identity(lm), max_bytes or DEFAULT_SHARED_BYTES, clock)
        self.block_size = block_size
        self.shape = (lm.layers, 2, lm.kv_heads, block_size, lm.head_dim)
        self.dtype, self.device = lm.dtype, lm.device
        self.counters = SharedCounters()

    def has(self, key: int) -> bool:
        return self.dir.contains(key)

    def read(self, keys: Sequence[int]) -> torch.Tensor | None:
        """(engine thread) KV of the longest leading run of `keys` held and verified, joined along
        the token axis, on the model's device; None if the first is missing or bad."""
        start = time.perf_counter()
        parts = []
        for key in keys:
            try:
                kv = self.dir.get(key)
            except CorruptKV:
                break   # counted and removed by the directory: these tokens are recomputed
            if kv is None:
                break
            if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
                self.dir.discard(key)   # a valid file of another geometry under our key
                break
            parts.append(kv)
        self.counters.read_seconds += time.perf_counter() - start
        if not parts:
            return None
        return torch.cat(parts, dim=3).to(self.device)

    def write(self, keys: Sequence[int], kv: torch.Tensor) -> int:
        """(worker thread) Store `kv` (the tokens of `len(keys)` full blocks) one file per block;
        returns the files written. Never raises: a failed write only costs a later recompute."""
        bs, written = self.block_size, 0
        for i, key in enumerate(keys):
            try:
                written += self.dir.put(key, kv[:, :, :, i * bs:(i + 1) * bs])
            except (OSError, RuntimeError, ValueError, SafetensorError) as e:   # a full disk: SafetensorError
                self.counters.write_errors += 1
                if worth_logging(self.counters.write_errors):
                    log.warning("cannot write to the shared KV folder %s (%d failed writes so far; that KV is "
                                "recomputed where needed): %s", self.dir.directory, self.counters.write_errors, e)
        self.counters.blocks_written += written
        return written


class SharedOps:
    """Mixed into `HFEngine` (engine.py), which holds `shared` (a `SharedTier` or None), `peer`
    (a `PeerInbox`: blocks other replicas sent), `tree`,
    `rates`, `opts`, `stats`, `store`, `tokenize` and `_prompts`. Runs on the engine thread."""

    def would_read_outside(self, tokens: int) -> bool:
        """Whether this engine's load rule reads `tokens` tokens of KV from outside it (another
        replica, the shared directory) rather than recompute them: `auto` compares the measured
        rates (a small model on a CPU prefills a few blocks faster than one load's fixed latency)."""
        rule = self.opts.load_rule
        if rule == "recompute":
            return False
        return rule != "auto" or self.rates.load_seconds([0, 0, 0, tokens]) <= self.rates.prefill_seconds(tokens)

    def _shared_keys(self, req) -> list[int]:
        tokens = self._prompts.get(id(req)) or self.tokenize(req.call)
        return block_hashes(tokens, self.tree.block_size)

    def _read_shared(self, req, device: int, cap: int) -> tuple[torch.Tensor | None, list[int] | None]:
        """KV from outside this engine for the prompt tokens from `device` (the local prefix,
        whole blocks) on, at most up to `cap`: blocks another replica sent for this call
        (`peer.py`), then the shared directory. (KV or None, the prompt's keys when computed)."""
        sources = [s for s in (self.peer, self.shared) if s is not None]
        bs = self.tree.block_size
        if not sources or device >= cap or device % bs or self.opts.load_rule == "recompute":
            return None, None
        first, last = device // bs, min(req.call.input_length // bs, -(-cap // bs))
        if first >= last:
            return None, None
        keys = self._shared_keys(req)
        want = min(last * bs, cap) - device
        if not any(s.has(keys[first]) for s in sources) or not self.would_read_outside(want):
            return None, keys
        start = time.perf_counter()
        kv = _read_chain(sources, keys[first:last], bs)
        if kv is None:
            return None, keys
        self.rates.saw_load(SHARED, kv.numel() * kv.element_size(), time.perf_counter() - start)
        kv = kv[:, :, :, :min(kv.shape[3], cap - device)]
        self.stats.loaded_tokens[SHARED] += kv.shape[3]
        return kv, keys

    def _write_shared(self, tokens: list[int], reused: int, kv, keys: list[int] | None) -> None:
        """Queue the prompt's full blocks that this prefill computed (those ending after the
        `reused` tokens) for the shared directory; `kv` is the prefill's extended cache."""
        sh, bs = self.shared, self.tree.block_size
        if sh is None:
            return
        first, last = reused // bs, len(tokens) // bs
        if first >= last:
            return
        keys = keys or block_hashes(tokens, bs)
        self.store.worker.submit(sh.write, keys[first:last], cache_to_kv(kv, first * bs, last * bs))


def _read_chain(sources, keys: list[int], block_size: int) -> torch.Tensor | None:
    """The longest leading run of `keys` read from `sources` in turn, each going on where the
    one before stopped."""
    parts, i = [], 0
    for source in sources:
        if i >= len(keys):
            break
        kv = source.read(keys[i:])
        if kv is not None:
            parts.append(kv)
            i += kv.shape[3] // block_size
    return torch.cat(parts, dim=3) if len(parts) > 1 else (parts[0] if parts else None)
