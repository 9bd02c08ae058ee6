"""The worker side of the connector: per-block KV in RAM or disk, copied to/from vLLM's paged cache.

Imports no vLLM. One entry per block key (a vLLM block hash): a tensor of every attention
layer's slice of that block, stacked ([layers, *block_shape]), in RAM or in one safetensors
file (metadata: format and the sha256 of the tensor bytes; the store keeps the checksum too, and
a read that does not match both raises `CorruptKV`: a damaged block is never served).

The paged cache's block dimension is found per layer as the dimension of size `num_blocks`
(0 on vLLM's CPU backend, 1 on CUDA backends that put K/V first), so no backend layout is
hard-coded. Plans are executed in order: moves, loads (before the forward), saves (after it).
With tensor parallelism every rank runs its own store over its own KV shard, with the same keys
and the same plan (the scheduler's decisions reach all ranks); files carry the rank in their name.
With a shared directory (`shared.py`) a rank also loads blocks from it (checked; a missing or
bad one is reported as a failed load, so vLLM recomputes it) and writes the blocks it computed
there, once, on a writer thread (the copy out of the paged cache is made first, in step).

Failures never raise into vLLM: a load that fails is recorded (`failed`: vLLM recomputes the
block) and the store forgets that key (its copy is bad or gone, so no later load trusts it); a
disk write that fails (directory removed, disk full) is counted and logged once, and the key is
then not held at all, so a later load of it fails the same way. A save replaces any copy held
(the scheduler plans a save of a held key only when that copy is owed: missing or wrong).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from pbkv.engine.hf.disk import CorruptKV, tensor_sha256
from pbkv.integrations.vllm.plan import Plan, tainted

FORMAT = "pbkv-vllm-block"
log = logging.getLogger("pbkv.vllm")


class MissingKV(CorruptKV):
    """A planned read of a key the store holds no file of (never written, or its write failed):
    counted as `missing` only, not as `corrupt` (no file was damaged)."""


@dataclass
class StoreStats:
    saved_blocks: int = 0
    loaded_ram_blocks: int = 0    # loads whose KV was in RAM before this step's moves
    loaded_disk_blocks: int = 0   # loads whose KV came from a disk file, read by the load or by
                                  # a ("host", key) move of the same step (the shadow's disk_hit_tokens)
    files_written: int = 0
    corrupt: int = 0        # files that were unreadable or failed their checksum
    missing: int = 0        # a planned load or move of a key the store does not hold
    loaded_shared_blocks: int = 0
    shared_failed: int = 0  # planned shared loads that found no valid file (vLLM recomputes them)
    shared_queued: int = 0  # blocks handed to the shared writer
    write_failed: int = 0   # disk-tier writes that failed (the block is then not held)
    load_failed: int = 0    # planned local loads that failed (missing or corrupt; vLLM recomputes)


class BlockStore:
    def __init__(self, directory: str | Path | None = None, rank: int = 0, shared=None):
        self._own = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="pbkv-vllm-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._own:
            weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self.rank = rank
        self.ram: dict[int, torch.Tensor] = {}
        self.disk: dict[int, tuple[Path, str]] = {}     # key -> (file, sha256)
        self.layers: list[tuple[torch.Tensor, int]] = []  # (paged cache, block dim)
        self.stats = StoreStats()
        self.failed: set[int] = set()                   # block ids whose load failed this step
        self._from_disk: set[int] = set()               # keys a ("host", key) move read from disk this step
        self.shared = shared                            # `shared.SharedBlocks` of this rank, or None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pbkv-shared") if shared is not None else None

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Remember vLLM's paged KV tensors (one per attention layer) and their block dimension."""
        self.layers = []
        for name, t in kv_caches.items():
            dims = [d for d in range(min(2, t.dim())) if t.shape[d] == num_blocks]
            if not dims:
                raise ValueError(f"layer {name}: no dimension of size num_blocks={num_blocks} in {tuple(t.shape)}")
            self.layers.append((t, dims[0]))

    # ------------------------------------------------------------------ plan execution

    def before_forward(self, plan: Plan) -> None:
        """A step's moves, then its loads (failures land in `failed`)."""
        for op, key in plan.moves:
            self.move(op, key)
        try:
            for key, block_id in plan.loads:
                self.load(key, block_id)
        finally:
            self._from_disk.clear()   # a promotion counts only for the loads of its own step
        for block_hash, block_id in plan.shared_loads:
            self.load_shared(block_hash, block_id)

    def after_forward(self, plan: Plan) -> None:
        """A step's saves, except those of blocks computed from a block whose load failed this
        step (`plan.tainted`): their content is wrong, and vLLM recomputes them."""
        bad = tainted(plan.chains, self.failed)
        for key, block_id in plan.saves:
            if block_id not in bad:
                self.save(key, block_id)
        for block_hash, block_id in plan.shared_saves:
            if block_id not in bad:
                self.save_shared(block_hash, block_id)

    def move(self, op: str, key: int) -> None:
        if op == "drop":
            self.ram.pop(key, None)
            self._from_disk.discard(key)
            self._unlink(key)
        elif op == "disk":
            self._from_disk.discard(key)
            data = self.ram.pop(key, None)
            if data is None:
                self.stats.missing += 1
                return
            self._write(key, data)
        elif op == "host":
            if key in self.ram:
                return
            try:
                self.ram[key] = self._read(key)
                self._from_disk.add(key)   # a load of it this step serves disk KV (see `load`)
            except MissingKV:
                pass                       # counted as missing by `_read`
            except CorruptKV:
                self.stats.corrupt += 1
            self._unlink(key)
        else:
            raise ValueError(f"unknown move {op!r}")

    def load(self, key: int, block_id: int) -> bool:
        """Copy a stored block into the paged cache; False (block id recorded) if unreadable."""
        data = self.ram.get(key)
        try:
            if data is None:
                data = self._read(key)
                self.stats.loaded_disk_blocks += 1
            elif key in self._from_disk:   # read from its file by this step's ("host", key) move
                self._from_disk.discard(key)   # a second load of it this step is a RAM hit (as the shadow counts)
                self.stats.loaded_disk_blocks += 1
            else:
                self.stats.loaded_ram_blocks += 1
        except CorruptKV as e:
            if not isinstance(e, MissingKV):   # a missing key is counted as missing by `_read` only
                self.stats.corrupt += 1
            self.stats.load_failed += 1
            self.failed.add(block_id)
            self.ram.pop(key, None)
            self._unlink(key)
            return False
        for i, (t, dim) in enumerate(self.layers):
            t.select(dim, block_id).copy_(data[i])
        return True

    def save(self, key: int, block_id: int) -> None:
        """Copy a computed block into RAM, replacing any copy held (see the module docstring)."""
        self._unlink(key)
        self._from_disk.discard(key)
        self.ram[key] = torch.stack([t.select(dim, block_id).to("cpu", copy=True) for t, dim in self.layers])
        self.stats.saved_blocks += 1

    def load_shared(self, block_hash, block_id: int) -> bool:
        """Copy a block from the shared directory into the paged cache; False (block id recorded
        as failed) if it is missing, bad, or of another shape or dtype than the paged cache.
        Invariant: only an exact match is copied (`copy_` would cast another dtype silently; the
        identity in the file's key names the dtype, but a file is not trusted to match its key)."""
        data = self.shared.get(block_hash)
        if data is not None and not self._fits(data, block_id):
            self.shared.discard(block_hash)   # else it would miss here for ever: no writer replaces a file
            data = None
        if data is None:
            self.stats.shared_failed += 1
            self.failed.add(block_id)
            return False
        for i, (t, dim) in enumerate(self.layers):
            t.select(dim, block_id).copy_(data[i])
        self.stats.loaded_shared_blocks += 1
        return True

    def save_shared(self, block_hash, block_id: int) -> None:
        """Queue a computed block for the shared directory (skipped when a file is there)."""
        if self.shared.prefix([block_hash]):
            return
        data = torch.stack([t.select(dim, block_id).to("cpu", copy=True) for t, dim in self.layers])
        self.stats.shared_queued += 1
        self._writer.submit(self.shared.put, block_hash, data)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _fits(self, data: torch.Tensor, block_id: int) -> bool:
        """Whether `data` is one block of every layer, as the paged cache holds it (layer 0's
        shape and dtype: vLLM gives every attention layer of a model the same)."""
        t, dim = self.layers[0]
        return data.dtype == t.dtype and tuple(data.shape) == (len(self.layers), *t.select(dim, block_id).shape)

    def _write(self, key: int, data: torch.Tensor) -> None:
        """Write one block's file; on failure keep nothing for `key` (count it, log the first)."""
        path = self.directory / f"r{self.rank}-{key:016x}.safetensors"
        digest = tensor_sha256(data)
        try:
            # save_file's mode, 0600: this store's KV (users' prompts) is for this process only
            save_file({"kv": data.contiguous()}, str(path), metadata={"format": FORMAT, "sha256": digest})
        except (OSError, RuntimeError, SafetensorError) as e:
            if not self.stats.write_failed:
                log.warning("pbkv connector: disk tier write to %s failed (%s: %s); blocks that fail to be "
                            "written are dropped (vLLM recomputes them); further failures are counted only",
                            path, type(e).__name__, e)
            self.stats.write_failed += 1
            _remove(path)   # a partial file must not outlive its failed write
            return
        self.disk[key] = (path, digest)
        self.stats.files_written += 1

    def _read(self, key: int) -> torch.Tensor:
        entry = self.disk.get(key)
        if entry is None:
            self.stats.missing += 1
            raise MissingKV(f"block {key:x}: not stored")
        path, digest = entry
        try:
            raw = path.read_bytes()
            data = st_load(raw)["kv"]
        except (OSError, KeyError, ValueError, SafetensorError) as e:
            raise CorruptKV(f"{path.name}: unreadable ({type(e).__name__})") from None
        if tensor_sha256(data) != digest:
            raise CorruptKV(f"{path.name}: checksum mismatch")
        return data

    def _unlink(self, key: int) -> None:
        entry = self.disk.pop(key, None)
        if entry is not None:
            _remove(entry[0])


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass   # forgotten either way: a file the store does not list is never read
