"""The shared KV tier: content keys, atomic concurrent writes, checks on read, the byte bound."""

from __future__ import annotations

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
