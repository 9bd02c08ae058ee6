"""The shared KV tier: content keys, atomic concurrent writes, checks on read, the byte bound."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os

import pytest
import torch

from pbkv.engine.kvfile import CorruptKV
from pbkv.engine.shared_kv import SharedKVDir, model_identity

MODEL = model_identity("tiny", torch.float32, 2, 2, 8)


def block(h: int) -> torch.Tensor:
    """Deterministic KV of one 16-token block, as a model would compute it for chained hash h."""
    g = torch.Generator().manual_seed(h)
    return torch.randn(2, 2, 2, 16, 8, generator=g)


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_put_get_round_trip_and_keys(tmp_path):
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    assert s.get(7) is None and s.stats.misses == 1
    assert s.put(7, block(7)) is True
    assert s.put(7, block(7)) is False and s.stats.already_present == 1
    assert torch.equal(s.get(7), block(7))
    other = SharedKVDir(tmp_path, model_identity("smollm2", torch.float32, 2, 2, 8), 10**9)
    assert other.path(7) != s.path(7) and other.get(7) is None
    s.put(8, block(8))
    assert s.prefix_blocks([7, 8, 9, 7]) == 2
    assert [torch.equal(a, block(h)) for a, h in zip(s.get_prefix([7, 8, 9]), [7, 8])] == [True, True]


def test_a_flipped_byte_is_detected_and_the_file_removed(tmp_path):
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    s.put(1, block(1))
    p = s.path(1)
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0x40
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptKV, match="checksum mismatch"):
        s.get(1)
    assert not p.exists() and s.stats.corrupt == 1
    assert s.get(1) is None


def test_truncated_and_substituted_files_are_refused(tmp_path):
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    s.put(1, block(1))
    s.put(2, block(2))
    s.path(1).write_bytes(s.path(1).read_bytes()[:100])
    with pytest.raises(CorruptKV, match="unreadable"):
        s.get(1)
    s.put(3, block(3))
    s.path(3).write_bytes(s.path(2).read_bytes())   # a valid file under the wrong key
    with pytest.raises(CorruptKV, match="checksum mismatch"):
        s.get(3)
    assert s.stats.corrupt == 2 and torch.equal(s.get(2), block(2))


def test_a_file_holding_a_scalar_is_refused(tmp_path):
    """Before: hashing its 0-dim tensor raised RuntimeError, not CorruptKV, out of the reader."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    s.put(1, block(1))
    p = s.path(1)
    with safe_open(str(p), "pt") as f:
        meta = f.metadata()   # the real file's: only the tensor is other data
    save_file({"kv": torch.tensor(1.0)}, str(p), metadata=meta)
    with pytest.raises(CorruptKV, match="checksum mismatch"):
        s.get(1)
    assert not p.exists() and s.stats.corrupt == 1


def test_the_byte_bound_evicts_least_recently_used(tmp_path):
    clock = Clock()
    probe = SharedKVDir(tmp_path / "probe", MODEL, 10**9)
    probe.put(0, block(0))
    size = probe.path(0).stat().st_size
    s = SharedKVDir(tmp_path / "kv", MODEL, int(3.5 * size), clock=clock)
    for h in (1, 2, 3):
        clock.t += 1
        s.put(h, block(h))
    clock.t += 1
    s.get(1)                      # 1 is now more recent than 2 and 3
    clock.t += 1
    s.put(4, block(4))            # over the bound: the least recently used (2) goes
    assert [h for h in (1, 2, 3, 4) if s.contains(h)] == [1, 3, 4]
    clock.t += 1
    s.put(5, block(5))
    assert [h for h in (1, 2, 3, 4, 5) if s.contains(h)] == [1, 4, 5]
    assert s.total_bytes() <= s.max_bytes and s.stats.evicted_files == 2


def test_several_writers_keep_the_folder_within_the_bound(tmp_path):
    # four processes' handles on one folder, one bound (as four `pbkv serve --shared-dir D
    # --shared-bytes N`): the KV files never pass N, counted as whole files (headers too), and
    # a writer scans the folder every 1/40 of the bound it writes, not at every put
    clock = Clock()
    probe = SharedKVDir(tmp_path / "probe", MODEL, 10**9)
    probe.put(0, block(0))
    size = probe.path(0).stat().st_size
    assert probe.stats.bytes_written == size        # the whole file, not the tensor's 4,096 bytes
    bound = 120 * size
    writers = [SharedKVDir(tmp_path / "kv", MODEL, bound, clock=clock) for _ in range(4)]
    scans = []
    for w in writers:
        w.evict = (lambda evict: lambda *a, **k: scans.append(1) or evict(*a, **k))(w.evict)
    worst = 0
    for h in range(1, 601):
        clock.t += 1
        writers[h % 4].put(h, block(h))
        worst = max(worst, writers[0].total_bytes())
    assert worst <= bound and 0.85 * bound <= writers[0].total_bytes() <= bound
    assert len(scans) <= 600 // 3
    recent = [h for h in range(1, 601) if writers[0].contains(h)]
    assert recent == list(range(601 - len(recent), 601))   # the least recently written went first


def test_eviction_never_touches_files_that_are_not_its_own(tmp_path):
    clock = Clock()
    for name, content in (("docs/thesis.tex", "mine"), ("ab/notes.txt", "mine too"), ("README", "top")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
        os.utime(tmp_path / name, (1.0, 1.0))              # older than any KV file
    (tmp_path / "ab" / "nested").mkdir()                    # a folder in a key folder: never unlinked
    probe = SharedKVDir(tmp_path / "probe", MODEL, 10**9)
    probe.put(0, block(0))
    size = probe.path(0).stat().st_size
    s = SharedKVDir(tmp_path, MODEL, int(2.5 * size), clock=clock)
    for h in range(1, 6):
        clock.t += 1
        s.put(h, block(h))
    assert [h for h in range(1, 6) if s.contains(h)] == [4, 5]    # the bound holds, by its own files only
    for name in ("docs/thesis.tex", "ab/notes.txt", "README"):
        assert (tmp_path / name).exists(), name
    assert (tmp_path / "ab" / "nested").is_dir() and s.total_bytes() == 2 * size


def test_a_reader_without_write_access_reads_and_misses_but_never_raises_else(tmp_path, monkeypatch):
    from pathlib import Path
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    s.put(1, block(1))
    s.put(2, block(2))
    s.path(2).write_bytes(s.path(2).read_bytes()[:100])

    def denied(*args, **kwargs):   # another user's files in a folder this reader may not write
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(os, "utime", denied)
    monkeypatch.setattr(Path, "unlink", denied)
    assert torch.equal(s.get(1), block(1))                 # its mtime could not be touched: still a hit
    with pytest.raises(CorruptKV):                         # a bad file it cannot remove: a miss to the engine
        s.get(2)
    assert s.evict() == 0
    s.discard(1)                                           # a reader's "another geometry": best effort too
    monkeypatch.undo()
    assert s.contains(1) and s.stats.corrupt == 2
    s.discard(1)
    assert not s.contains(1) and s.stats.corrupt == 3


def test_a_file_whose_tensor_is_not_the_recorded_shape_is_refused(tmp_path):
    from safetensors.torch import load_file, safe_open, save_file
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    s.put(1, block(1))
    with safe_open(str(s.path(1)), "pt") as f:
        meta = f.metadata()
    kv = load_file(str(s.path(1)))["kv"].reshape(-1)      # same bytes and checksum, another shape
    save_file({"kv": kv}, str(s.path(1)), metadata=meta)
    with pytest.raises(CorruptKV, match="not the one recorded"):
        s.get(1)


def test_the_bound_and_the_folder_are_checked(tmp_path):
    for bad in (0, 0.5, True, -5):
        with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
            SharedKVDir(tmp_path, MODEL, bad)
    with pytest.raises(ValueError, match="empty path"):
        SharedKVDir("", MODEL, 10**9)


def test_stale_temp_files_are_cleaned(tmp_path):
    clock = Clock()
    s = SharedKVDir(tmp_path, MODEL, 10**9, clock=clock)
    s.put(1, block(1))
    tmp = s.path(1).parent / ".tmp-999-1-0"
    tmp.write_bytes(b"partial")
    os.utime(tmp, (clock.t, clock.t))
    s.evict()
    assert tmp.exists()
    clock.t += 601
    s.evict()
    assert not tmp.exists() and s.contains(1)


def test_a_temp_file_of_a_write_in_flight_counts_toward_the_bound(tmp_path):
    clock = Clock()
    probe = SharedKVDir(tmp_path / "probe", MODEL, 10**9)
    probe.put(0, block(0))
    size = probe.path(0).stat().st_size
    s = SharedKVDir(tmp_path / "kv", MODEL, 3 * size, clock=clock)
    for h in (1, 2):
        clock.t += 1
        s.put(h, block(h))
    tmp = s.path(1).parent / ".tmp-999-1-0"   # another process's file, being written
    tmp.write_bytes(b"x" * size)
    os.utime(tmp, (clock.t, clock.t))
    s.evict()   # 3 files' worth is over 90% of 3: the oldest KV file (1) makes room
    assert [h for h in (1, 2) if s.contains(h)] == [2] and tmp.exists()


def _writer(directory: str, keys: list[int], barrier, results) -> None:
    s = SharedKVDir(directory, MODEL, 10**9)
    barrier.wait()
    bad = []
    for _ in range(3):
        for h in keys:
            s.put(h, block(h))
            got = s.get(h)
            if got is None or not torch.equal(got, block(h)):
                bad.append(h)
    results.put(bad)


def test_two_processes_write_and_read_the_same_keys(tmp_path):
    ctx = mp.get_context("spawn")   # fork after torch is loaded may deadlock
    keys = list(range(100, 160))
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), order, barrier, results))
             for order in (keys, keys)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert got == [[], []] and [p.exitcode for p in procs] == [0, 0]
    s = SharedKVDir(tmp_path, MODEL, 10**9)
    assert all(torch.equal(s.get(h), block(h)) for h in keys) and s.stats.corrupt == 0
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_a_directory_removed_while_in_use_is_made_again_by_the_next_write(tmp_path):
    """Before: every write after an `rm -rf` of the directory failed (its 2-hex subfolder's
    parent was gone), so the tier stayed dead until a restart."""
    import shutil
    root = tmp_path / "shared"
    s = SharedKVDir(root, MODEL, 10**9)
    assert s.put(1, block(1))
    shutil.rmtree(root)
    assert s.get(1) is None and s.put(2, block(2)) and torch.equal(s.get(2), block(2))


def test_a_folder_that_cannot_be_written_gets_a_warning_at_start_and_is_still_read(tmp_path, monkeypatch, caplog):
    import logging
    SharedKVDir(tmp_path, MODEL, 10**9).put(1, block(1))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if mode & os.W_OK else real(p, mode, **k))
    with caplog.at_level(logging.WARNING, logger="pbkv.engine"):
        readers = [SharedKVDir(tmp_path, MODEL, 10**9) for _ in range(2)]   # e.g. two tensor-parallel ranks
    warned = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert warned == [f"the shared KV folder {tmp_path} is not writable (read-only or permission denied): KV "
                      f"is read from it, but none is written there"]   # once per folder
    assert torch.equal(readers[0].get(1), block(1))


def test_a_block_file_follows_the_umask(tmp_path):
    """Other accounts' replicas read the tier: under umask 022 a block file is 0644 (before: 0600,
    safetensors' save_file, so another account's replica could not read it)."""
    old = os.umask(0o022)
    try:
        s = SharedKVDir(tmp_path, MODEL, 10**9)
        s.put(1, block(1))
    finally:
        os.umask(old)
    assert s.path(1).stat().st_mode & 0o777 == 0o644
    assert s.path(1).parent.stat().st_mode & 0o777 == 0o755
