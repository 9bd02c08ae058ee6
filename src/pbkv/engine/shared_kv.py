"""A KV tier every replica can read: one directory, content-addressed, checked, bounded.

Entries are per block. The key of a block is sha256(model identity, chained block hash): a
chained hash names the whole prefix up to that block (`pbkv.engine.hf.tokens.block_hashes` is stable across
processes), and the model identity keeps two models' KV apart in one directory. Any process
that computes the same prefix with the same model writes the same bytes under the same key.

Invariants:
- a file is only ever seen complete: writers write a unique temp file in the same directory
  and `os.replace` it onto the key's name (atomic on POSIX), so two processes writing one key
  race harmlessly: the last rename wins and both contents are valid;
- a read returns data only if the file parses, its metadata names our format, this key and
  model, and its tensor hashes to the sha256 in its metadata; otherwise `CorruptKV` is raised
  and the file is removed (it would fail every reader);
- the directory's KV files and temp files stay within `max_bytes` while at most `QUIET_WRITERS` (4) processes
  write to it with that bound, with no lock between them: `evict` brings them down to
  `LOW_WATER` (90%) of `max_bytes`, removing the least recently used first (reads touch a
  file's mtime), and a writer runs it (making room for the file it adds) before the bytes it
  wrote since its last `evict` (whole files, headers included) would pass `SCAN_EVERY` (1/40) of
  the bound; so W writers hold at most 90% + W/40 of the bound: each writer past the fourth may
  add 1/40 of it (a single block larger than 90% of the bound is still written, alone);
  a temp file younger than `STALE_TEMP_S` (a write in flight, or a writer that died less than
  that ago) counts toward the bound, so `evict` makes room for it among the KV files; an older
  one is removed (its writer died); `evict` only ever counts and removes its
  own names (`KEY_DIR/KEY_FILE`, `.tmp-*` in them): a directory that also holds other files (a
  user's) keeps them;
- reading needs read access only (a folder this process cannot write is used, with a warning at
  start): touching a file's mtime and removing a corrupt file are
  best effort (a replica may read a directory another user's replicas write).
Time comes from the injected `clock` (seconds since the epoch, as file mtimes are).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from pbkv.engine.kvfile import CorruptKV, load_kv, tensor_sha256
from pbkv.files import write_tensors

FORMAT = "pbkv-shared-kv"
SUFFIX = ".safetensors"
KEY_DIR = re.compile(r"[0-9a-f]{2}")                  # the first two hex digits of a key
KEY_FILE = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))
log = logging.getLogger("pbkv.engine")
_WARNED: set[str] = set()   # folders warned about as not writable (read-only mount, another user's)
STALE_TEMP_S = 600.0   # a temp file this old belongs to a writer that died
LOW_WATER = 0.9        # `evict` brings the KV files down to this share of max_bytes ...
SCAN_EVERY = 40        # ... and a writer runs it before writing max_bytes // SCAN_EVERY more
QUIET_WRITERS = 4      # writers that stay within the bound: LOW_WATER + QUIET_WRITERS / SCAN_EVERY <= 1


def model_identity(name: str, dtype: torch.dtype | str, layers: int, kv_heads: int, head_dim: int) -> str:
    """What must match for KV to be interchangeable: weights, dtype and the cache's shape."""
    return f"{name}|{dtype}|{layers}x{kv_heads}x{head_dim}"


@dataclass
class SharedStats:
    puts: int = 0
    already_present: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evicted_files: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class SharedKVDir:
    """The shared tier over `directory` (see the module docstring)."""

    def __init__(self, directory: str | Path, model_id: str, max_bytes: int,
                 clock: Callable[[], float] = time.time):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if not str(directory):
            raise ValueError("the shared KV directory is an empty path; give a folder")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if not os.access(self.directory, os.W_OK | os.X_OK) and str(self.directory) not in _WARNED:
            _WARNED.add(str(self.directory))   # once per folder: a vLLM process opens it once per rank
            log.warning("the shared KV folder %s is not writable (read-only or permission denied): KV is "
                        "read from it, but none is written there", self.directory)
        self.model_id, self.max_bytes, self.clock = model_id, max_bytes, clock
        self.stats = SharedStats()
        self._names = itertools.count()
        self.low_water = int(max_bytes * LOW_WATER)     # what `evict` leaves
        self.scan_every = max(1, max_bytes // SCAN_EVERY)   # bytes a writer adds between its scans
        self._unscanned = self.scan_every   # bytes written since the last scan: scan on the first put

    def key(self, block_hash: int) -> str:
        return hashlib.sha256(f"{self.model_id}\0{block_hash}".encode()).hexdigest()

    def path(self, block_hash: int) -> Path:
        k = self.key(block_hash)
        return self.directory / k[:2] / (k + SUFFIX)

    def contains(self, block_hash: int) -> bool:
        return self.path(block_hash).is_file()

    def prefix_blocks(self, hash_ids: Sequence[int]) -> int:
        """How many leading blocks of a prompt the tier holds (chained: stop at the first miss)."""
        n = 0
        for h in hash_ids:
            if not self.contains(h):
                break
            n += 1
        return n

    def put(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Store one block's KV; False if the key was already there (nothing written)."""
        final = self.path(block_hash)
        if final.is_file():
            self.stats.already_present += 1
            return False
        final.parent.mkdir(parents=True, exist_ok=True)   # parents: the directory itself may have been removed
        data = kv.detach().to("cpu").contiguous()
        tmp = final.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._names)}"
        meta = {"format": FORMAT, "key": self.key(block_hash), "model": self.model_id,
                "sha256": tensor_sha256(data), "shape": json.dumps(list(data.shape))}
        try:
            write_tensors(tmp, {"kv": data}, metadata=meta)   # umask mode: other accounts' replicas read it
            size = tmp.stat().st_size   # the whole file, header included: what `evict` counts
            scan = self._unscanned + size > self.scan_every
            if scan:
                self.evict(room=size, writing=tmp.name)   # before the rename, making room for it: within low_water after it
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        self._touch(final)
        if not scan:
            self._unscanned += size
        self.stats.puts += 1
        self.stats.bytes_written += size
        return True

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV, verified; None if absent; `CorruptKV` (file removed) if it fails a check."""
        path = self.path(block_hash)
        if not path.is_file():
            self.stats.misses += 1
            return None
        try:
            meta, data = load_kv(path)
            if meta.get("format") != FORMAT or meta.get("key") != self.key(block_hash) \
                    or meta.get("model") != self.model_id or tensor_sha256(data) != meta.get("sha256"):
                raise CorruptKV(f"{path.name}: checksum mismatch")
            if meta.get("shape") != json.dumps(list(data.shape)):
                raise CorruptKV(f"{path.name}: shape {list(data.shape)} is not the one recorded")
        except CorruptKV as e:
            if "file missing" in str(e):   # evicted by another process between the check and the read
                self.stats.misses += 1
                return None
            self.stats.corrupt += 1
            _remove(path)   # it would fail every reader; a reader without write access leaves it
            raise
        self._touch(path)
        self.stats.hits += 1
        self.stats.bytes_read += data.numel() * data.element_size()
        return data

    def discard(self, block_hash: int) -> None:
        """A verified file a reader cannot use (another geometry under this key): count it as
        corrupt and remove it, so the next writer replaces it (best effort, as in `get`)."""
        self.stats.corrupt += 1
        _remove(self.path(block_hash))

    def get_prefix(self, hash_ids: Sequence[int]) -> list[torch.Tensor]:
        """Verified KV of the longest leading run of blocks the tier holds (stops at a miss)."""
        out = []
        for h in hash_ids:
            kv = self.get(h)
            if kv is None:
                break
            out.append(kv)
        return out

    def evict(self, room: int = 0, writing: str = "") -> int:
        """Remove least recently used files until the total is within `low_water` less `room` (the
        size of a file about to be added: the temp file named `writing`, counted as `room` only);
        returns files removed. A periodic scan (`put`), not one
        per write: see the module docstring for the bound this gives."""
        self._unscanned = 0
        target = self.low_water - room
        files, total, now = [], 0, self.clock()
        for sub in self.directory.iterdir():
            if not (KEY_DIR.fullmatch(sub.name) and sub.is_dir()):
                continue   # not one of ours: never counted, never removed
            for entry in os.scandir(sub):
                temp = entry.name.startswith(".tmp-")
                if entry.name == writing:
                    continue
                if not (temp or KEY_FILE.fullmatch(entry.name)) or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue   # another process removed it
                if temp:
                    if now - st.st_mtime > STALE_TEMP_S:
                        _remove(Path(entry.path))
                    else:
                        total += st.st_size   # another writer's file to be: it counts, but is not ours to remove
                    continue
                files.append((st.st_mtime, entry.name, entry.path, st.st_size))
                total += st.st_size
        removed = 0
        for _, _, path, size in sorted(files):
            if total <= target:
                break
            if _remove(Path(path)):
                total -= size
                removed += 1
        self.stats.evicted_files += removed
        return removed

    def _touch(self, path: Path) -> None:
        """Set the file's mtime to the clock: recency for `evict`."""
        now = self.clock()
        try:
            os.utime(path, (now, now))
        except OSError:
            pass   # evicted by another process meanwhile, or another user's file: recency is a hint

    def total_bytes(self) -> int:
        """Bytes of the KV files (`KEY_DIR/KEY_FILE`) the directory holds."""
        return sum(p.stat().st_size for p in self.directory.glob(f"*/*{SUFFIX}")
                   if KEY_DIR.fullmatch(p.parent.name) and KEY_FILE.fullmatch(p.name))


def _remove(path: Path) -> bool:
    """Unlink `path` if this process may; False when it may not (or it is gone)."""
    try:
        path.unlink()
        return True
    except OSError:
        return False
