"""KV tensors of radix nodes in three real tiers, always where the tree says each node lives.

`KVStore` is the `pbkv.cache.Storage` of a real engine: `TieredCache` calls it whenever it
changes a node's tier, splits a node or drops one, and the store moves the tensors to match.
- device: a tensor on the model's device. Without CUDA this is RAM too, and the device "pool"
  is exactly the tensors of device-tier nodes: its size is enforced by the cache's token
  capacity, as a GPU pool would be;
- host: a tensor in RAM (pinned under CUDA, so loads can run asynchronously);
- disk: a view (token offset, length) of a safetensors file under `directory`, one file per
  evicted node (a split node's halves share the file). Each file stores the sha256 of its tensor
  bytes in its metadata and the store remembers it too; a read checks both, so a corrupt,
  truncated, missing or substituted file raises `CorruptKV` and is never served. No pickle.

Invariant: every live node has `node.value` = a `KV` with `KV.tier == node.tier` (the bytes of a
disk entry may still be in flight to the file: readers then use the in-memory copy). Moves down
(eviction) copy device->host at once and write host->disk on the worker thread; moves up
(loads) are read on the worker thread, handed over with `stage`, and installed when the cache
completes the move. A node whose data proved unreadable is marked `lost`; a node whose disk
write failed is lost too (`is_lost`), and the engine hears of it (`failed_writes`) to drop it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from pbkv.cache import Node, Tier
from pbkv.engine.hf.disk import CorruptKV, DiskFile, read_file, tensor_sha256, write_file  # noqa: F401
from pbkv.engine.kvfile import worth_logging
from pbkv.stale import hold, remove_stale

log = logging.getLogger("pbkv.engine")
STALE_KV_DIR = r"pbkv-kv-(?P<pid>\d+)-\w+"  # a disk tier's own temp folder: prefix, owner PID, mkdtemp suffix


def _remove(directory: str, owner: list[int]) -> None:
    """A store's folder, then its owner mark (`pbkv.stale.hold`: one descriptor in `owner`).
    Run once, by `KVStore.close` or when the store is collected: a second close could close
    another file's descriptor."""
    shutil.rmtree(directory, ignore_errors=True)
    for fd in owner:
        os.close(fd)
    owner.clear()


@dataclass(eq=False)
class KV:
    tier: Tier
    tokens: int
    data: torch.Tensor | None = None   # device or host tier
    file: DiskFile | None = None       # disk tier
    offset: int = 0                    # first token of this entry in `file`
    lost: bool = False


@dataclass
class StoreStats:
    files_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    folder_remade: int = 0             # times the store's folder was gone at a write (made again)
    corrupt: int = 0                   # disk reads refused (checksum, truncation, missing file);
                                       # not reads of an entry whose write failed (`write_errors`)
    read_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])   # by source tier
    read_bytes: list[int] = field(default_factory=lambda: [0, 0, 0])


class KVStore:
    def __init__(self, device: torch.device, worker, directory: str | Path | None = None):
        self.device = device
        self.worker = worker
        self.pin = device.type == "cuda"
        # The store's files go in a folder of its own, in `directory` (the user's --disk-dir) or
        # the temp folder: two engines given one --disk-dir never overwrite each other's files,
        # and the folder goes with the store (nothing reads disk KV after a restart: the tree
        # that indexes it lived in memory). Folders of killed owners (kill -9 runs no finalizer)
        # go first.
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(parent, STALE_KV_DIR, marked=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f"pbkv-kv-{os.getpid()}-", dir=parent))
        # held for the store's life: another container sharing --disk-dir cannot judge our PID
        # the folder and the mark go once: at close(), else when the store is collected
        self._owner = [hold(self.directory)]   # a list: a remade folder gets a new mark (`_write`)
        self._remove = weakref.finalize(self, _remove, str(self.directory), self._owner)
        self.staged: dict[int, torch.Tensor] = {}
        # (engine thread) disk entries whose write has not succeeded yet: `failed_writes`
        self._writing: list[tuple[Node, DiskFile]] = []
        self.stats = StoreStats()
        self._names = itertools.count()

    # ------------------------------------------------------------------ engine API

    def attach(self, node: Node, kv: torch.Tensor) -> None:
        """A new device node's KV, straight from a prefill."""
        if kv.shape[3] != node.tokens:
            raise ValueError(f"{node}: KV of {kv.shape[3]} tokens for a node of {node.tokens}")
        node.value = KV(Tier.DEVICE, node.tokens, data=kv)

    def gather(self, nodes: list[Node], tokens: int) -> torch.Tensor | None:
        """The first `tokens` tokens of the KV along a root-side-first path of device nodes."""
        parts, left = [], tokens
        for n in nodes:
            if left <= 0:
                break
            kv = n.value
            if kv is None or kv.tier != Tier.DEVICE or n.tier != Tier.DEVICE:
                raise RuntimeError(f"{n}: KV not on the device")
            parts.append(kv.data[:, :, :, :min(left, kv.tokens)])
            left -= kv.tokens
        if left > 0:
            raise RuntimeError(f"path holds {tokens - left} of the {tokens} tokens asked for")
        return torch.cat(parts, dim=3) if len(parts) > 1 else (parts[0] if parts else None)

    def stage(self, node: Node, kv: torch.Tensor) -> None:
        """Data for a move up of `node` has arrived; `moved` installs it."""
        self.staged[node.id] = kv

    def is_lost(self, node: Node) -> bool:
        """Whether `node`'s KV cannot be served: unreadable, or its disk write failed."""
        kv = node.value
        return kv is None or kv.lost or (kv.file is not None and kv.file.error is not None)

    def failed_writes(self) -> list[Node]:
        """(engine thread) The live nodes whose disk write failed since the last call: their KV
        is gone, the engine drops them (the disk space they are counted in is free). Writes
        still running are kept for a later call."""
        failed, pending = [], []
        for node, f in self._writing:
            if f.data is not None:   # `_write` clears it last, after setting `error`
                pending.append((node, f))
            elif f.error is not None and node.alive and node.value is not None and node.value.file is f:
                failed.append(node)
        self._writing = pending
        return failed

    def mark_lost(self, node: Node) -> None:
        if node.value is not None:
            node.value.lost = True

    def read(self, kv: KV, files: dict | None = None) -> torch.Tensor:
        """(worker thread) A private copy of `kv`'s data on the device; `CorruptKV` if unreadable.
        `files` caches whole-file reads within one transfer (split halves share a file)."""
        start = time.perf_counter()
        if kv.lost:
            raise CorruptKV("entry marked lost")
        if kv.tier != Tier.DISK:
            out = kv.data.to(self.device, non_blocking=self.pin, copy=True)
        else:
            f = kv.file
            data = f.data
            if data is None:
                data = files.get(f.path) if files is not None else None
                if data is None:
                    data = self._read_file(f)
                    if files is not None:
                        files[f.path] = data
            out = data[:, :, :, kv.offset:kv.offset + kv.tokens].to(self.device, copy=True).contiguous()
        self.stats.read_seconds[kv.tier] += time.perf_counter() - start
        self.stats.read_bytes[kv.tier] += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        """Finish pending writes; delete the store's folder."""
        self.worker.close()
        self._remove()   # a finalizer runs at most once

    def check(self, tree) -> None:
        """Assert the module invariant over every live node, and that no file is orphaned
        (slow; for tests; call after `worker.drain()`)."""
        files = set()
        for n in tree.iter_nodes():
            kv = n.value
            assert kv is not None and kv.tier == n.tier and kv.tokens == n.tokens, (n, kv)
            if kv.tier == Tier.DISK:
                files.add(kv.file.path)
                assert kv.file.refs >= 1 and 0 <= kv.offset and kv.offset + kv.tokens <= kv.file.tokens
            else:
                assert kv.data.shape[3] == n.tokens and kv.data.device.type == (
                    self.device.type if kv.tier == Tier.DEVICE else "cpu"), (n, kv.data.shape)
        on_disk = set(self.directory.glob("*.safetensors"))
        assert on_disk <= files, f"orphaned KV files: {on_disk - files}"

    # ------------------------------------------------------------------ Storage protocol

    def moved(self, node: Node, src: Tier, dst: Tier) -> None:
        old: KV = node.value
        if dst < src:  # a completed load: its data was read on the worker thread
            data = self.staged.pop(node.id, None)
            if data is None:
                raise RuntimeError(f"{node}: moved up to {dst.name} without staged data")
            if dst == Tier.HOST:
                data = self._to_host(data)
            node.value = KV(dst, node.tokens, data=data, lost=old.lost)
            self._release(old)
            return
        data = old.data if old.tier != Tier.DISK else None
        if dst == Tier.HOST:
            node.value = KV(Tier.HOST, node.tokens, data=self._to_host(data), lost=old.lost)
        else:
            if data is None:
                raise RuntimeError(f"{node}: no in-memory data to write to disk")
            f = DiskFile(self.directory / f"kv-{next(self._names)}.safetensors", node.tokens,
                         data=self._to_host(data) if data.device.type != "cpu" else data)
            node.value = KV(Tier.DISK, node.tokens, file=f, lost=old.lost)
            self._writing.append((node, f))
            self.worker.submit(self._write, f)

    def split(self, upper: Node, lower: Node) -> None:
        old: KV = lower.value
        if old is None:
            return
        k = upper.tokens
        if old.tier == Tier.DISK:
            old.file.refs += 1
            upper.value = KV(Tier.DISK, k, file=old.file, offset=old.offset, lost=old.lost)
            lower.value = KV(Tier.DISK, lower.tokens, file=old.file, offset=old.offset + k, lost=old.lost)
            if old.file.data is not None or old.file.error is not None:   # the write runs or failed: both halves
                self._writing.append((upper, old.file))
            return
        # copies, not views: a view would keep the whole old tensor alive after one half moves
        head, tail = old.data[:, :, :, :k], old.data[:, :, :, k:]
        if old.tier == Tier.HOST:
            head, tail = self._to_host(head), self._to_host(tail)
        else:
            head, tail = head.clone(), tail.clone()
        upper.value = KV(old.tier, k, data=head, lost=old.lost)
        lower.value = KV(old.tier, lower.tokens, data=tail, lost=old.lost)

    def dropped(self, node: Node) -> None:
        self.staged.pop(node.id, None)
        if node.value is not None:
            self._release(node.value)
            node.value = None

    # ------------------------------------------------------------------ internals

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.pin:
            return t.to("cpu", copy=True)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t)
        return out

    def _release(self, kv: KV) -> None:
        f = kv.file
        if f is not None:
            f.refs -= 1
            if f.refs == 0:  # queued behind the file's write on the same FIFO worker
                self.worker.submit(f.path.unlink, missing_ok=True)

    def _write(self, f: DiskFile) -> None:
        """(worker thread) Write a disk entry; on failure the entry is lost, never half-served.
        A store folder removed under the running server (a cleanup job) is made again."""
        try:
            if not self.directory.is_dir():
                log.warning("the disk tier's folder %s was removed under the running server: made again "
                            "(the KV files it held are lost, their tokens recomputed when needed)", self.directory)
                self.directory.mkdir(parents=True, exist_ok=True)
                self._mark_again()
                self.stats.folder_remade += 1
            self.stats.bytes_written += write_file(f)
            self.stats.files_written += 1
        except (OSError, RuntimeError, SafetensorError) as e:   # safetensors' own error: not an OSError
            f.error = str(e)
            self.stats.write_errors += 1
            if worth_logging(self.stats.write_errors):
                log.error("disk-tier write failed (%d so far; that KV is lost, recomputed when needed): %s",
                          self.stats.write_errors, e)
        f.data = None  # readers now go to the file (or fail on f.error)

    def _mark_again(self) -> None:
        """(worker thread) The owner mark of a remade folder: the old mark's lock file went with
        the old folder, and a folder without one is another namespace's to remove after
        `GRACE_S` (`pbkv.stale`)."""
        old, self._owner[:] = list(self._owner), [hold(self.directory)]
        for fd in old:
            os.close(fd)

    def _read_file(self, f: DiskFile) -> torch.Tensor:
        try:
            return read_file(f)
        except CorruptKV:
            if f.error is None:   # a failed write is counted once, in `write_errors`, not as a corrupt file
                self._corrupt()
            raise

    def _corrupt(self) -> None:
        self.stats.corrupt += 1
