"""kill -9 of a server process leaves nothing behind: its retrain child exits, and its disk
tier's temp folder is removed by the next start. Deadline polls, no fixed sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from pbkv.engine.hf.kvstore import STALE_KV_DIR
from pbkv.stale import GRACE_S, OWNER, pid_alive, remove_stale

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The "server": starts the retrain pool, prints the child's PID, then waits to be killed.
PARENT = textwrap.dedent("""
    import os, sys
    from pbkv.serve.learning import start_pool
    pool, lifeline = start_pool(0)
    print(pool.submit(os.getpid).result(), flush=True)
    sys.stdin.read()
""")


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)  # polling interval, not a wait for an event to happen by itself
    return condition()


def test_the_retrain_child_exits_when_its_parent_is_killed():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_until(lambda: not pid_alive(child), 20), f"retrain child {child} outlived its parent"
    finally:
        parent.kill()
        parent.stdout.close()
        parent.stdin.close()


def test_stale_kv_folders_of_dead_owners_are_removed_at_start(tmp_path, monkeypatch):
    import torch
    from pbkv.engine.hf.kvstore import KVStore
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"pbkv-kv-{dead.pid}-abc_123"
    (stale / "sub").mkdir(parents=True)
    (stale / OWNER).touch()                # its owner's mark, no longer locked by anyone
    unmarked = tmp_path / f"pbkv-kv-{dead.pid}-old"
    unmarked.mkdir()                       # no mark (an older pbkv's), and old: removed too
    os.utime(unmarked, (time.time() - 2 * GRACE_S,) * 2)
    young = tmp_path / f"pbkv-kv-{dead.pid}-young"
    young.mkdir()                          # no mark yet: its owner may be about to lock it
    live = tmp_path / f"pbkv-kv-{os.getpid()}-xyz"
    live.mkdir()
    legacy = tmp_path / "pbkv-kv-noowner"  # no PID in the name: cannot tell, left alone
    legacy.mkdir()
    store = KVStore(torch.device("cpu"), worker=None)
    assert not stale.exists() and not unmarked.exists()
    assert young.exists() and live.exists() and legacy.exists()
    assert (store.directory / OWNER).is_file()
    assert store.directory.parent == tmp_path and store.directory.name.startswith(f"pbkv-kv-{os.getpid()}-")
    assert remove_stale(tmp_path, STALE_KV_DIR, marked=True) == []


def test_a_folder_held_by_a_process_in_another_pid_namespace_is_never_removed(tmp_path):
    """Two containers sharing --disk-dir: the other's PID in a folder name is dead (or another
    process) here. Before: a server removed the live disk tier of one in another container.
    Its flocked mark now says it is alive; once its holder ends, the folder goes."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = tmp_path / f"pbkv-kv-{dead.pid}-elsewhere"    # the PID as this namespace sees it
    other.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pbkv.stale import hold; "
                               "hold(sys.argv[1]); print('held', flush=True); time.sleep(600)", str(other)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert remove_stale(tmp_path, STALE_KV_DIR, marked=True) == [] and other.exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale(tmp_path, STALE_KV_DIR, marked=True) == [other] and not other.exists()


def test_two_stores_on_one_disk_dir_keep_apart_and_leave_nothing(tmp_path):
    import torch

    from pbkv.engine.hf.kvstore import KVStore
    from pbkv.engine.hf.transfer import Worker
    a, b = (KVStore(torch.device("cpu"), Worker(), tmp_path) for _ in range(2))
    assert a.directory != b.directory and {a.directory.parent, b.directory.parent} == {tmp_path}
    (tmp_path / "mine.txt").write_text("a user's file")
    a.close()
    assert not a.directory.exists() and b.directory.exists()
    b.close()
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_a_full_disk_is_a_write_error_not_a_disk_hit(tmp_path, monkeypatch):
    import torch
    from safetensors import SafetensorError

    from pbkv.engine.hf import kvstore
    from pbkv.engine.hf.disk import DiskFile
    from pbkv.engine.hf.transfer import Worker

    def full(f):   # what safetensors raises when the disk fills: not an OSError
        raise SafetensorError("Error while serializing: IoError(No space left on device)")
    monkeypatch.setattr(kvstore, "write_file", full)
    store = kvstore.KVStore(torch.device("cpu"), Worker(), tmp_path)
    f = DiskFile(store.directory / "kv-0.safetensors", 4, data=torch.zeros(1, 1, 1, 4, 2))
    store._write(f)
    assert store.stats.write_errors == 1 and f.error and f.data is None   # lost, never served from RAM
    store.close()


def test_a_disk_tier_file_is_private_to_the_process(tmp_path):
    """A private tier holds users' prompts as KV: 0600 whatever the umask (the shared tier's files
    follow the umask: other accounts' replicas read them)."""
    import torch

    from pbkv.engine.hf.disk import DiskFile, read_file, write_file
    f = DiskFile(tmp_path / "kv-0.safetensors", 4, data=torch.ones(1, 1, 1, 4, 2))
    old = os.umask(0o022)
    try:
        write_file(f)
    finally:
        os.umask(old)
    assert f.path.stat().st_mode & 0o777 == 0o600
    assert torch.equal(read_file(f), f.data)


def test_a_disk_tier_folder_removed_under_the_server_is_made_again(tmp_path):
    """Before: writes failed for the rest of the server's life, counted nowhere in /metrics."""
    import shutil

    import torch

    from pbkv.engine.hf import kvstore
    from pbkv.engine.hf.disk import DiskFile
    from pbkv.engine.hf.transfer import Worker
    store = kvstore.KVStore(torch.device("cpu"), Worker(), tmp_path)
    shutil.rmtree(store.directory)
    f = DiskFile(store.directory / "kv-0.safetensors", 4, data=torch.zeros(1, 1, 1, 4, 2))
    store._write(f)
    assert f.error is None and f.path.is_file()
    assert store.stats.folder_remade == 1 and store.stats.write_errors == 0
    # the remade folder is marked as ours again: another PID namespace's server sharing the
    # --disk-dir never removes it (before: unmarked, so removed once GRACE_S old)
    from pbkv.stale import _held
    os.utime(store.directory, (time.time() - 2 * GRACE_S,) * 2)
    assert _held(store.directory)
    store.close()
    assert not store.directory.exists()


def test_reading_an_entry_whose_write_failed_is_no_corrupt_file(tmp_path, monkeypatch):
    """Before: each later read of a KV entry whose write failed (disk full) counted a corrupt
    file, though no file was ever written; a real truncated file still counts as corrupt."""
    import pytest
    import torch
    from safetensors import SafetensorError

    from pbkv.cache import Tier
    from pbkv.engine.hf import kvstore
    from pbkv.engine.hf.disk import CorruptKV, DiskFile
    from pbkv.engine.hf.transfer import Worker

    store = kvstore.KVStore(torch.device("cpu"), Worker(), tmp_path)
    good = DiskFile(store.directory / "kv-1.safetensors", 4, data=torch.zeros(1, 1, 1, 4, 2))
    store._write(good)
    real_write = kvstore.write_file

    def full(f):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    monkeypatch.setattr(kvstore, "write_file", full)
    lost = DiskFile(store.directory / "kv-0.safetensors", 4, data=torch.zeros(1, 1, 1, 4, 2))
    store._write(lost)
    monkeypatch.setattr(kvstore, "write_file", real_write)
    for _ in range(2):
        with pytest.raises(CorruptKV, match="write failed"):
            store.read(kvstore.KV(Tier.DISK, 4, file=lost))
    assert (store.stats.write_errors, store.stats.corrupt) == (1, 0)
    good.path.write_bytes(good.path.read_bytes()[:-8])   # truncated: a corrupt file
    with pytest.raises(CorruptKV):
        store.read(kvstore.KV(Tier.DISK, 4, file=good))
    assert (store.stats.write_errors, store.stats.corrupt) == (1, 1)
    store.close()


def test_a_plot_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """Before: `error: [Errno 27] File too large`, naming no file."""
    import errno

    import pytest
    from matplotlib.figure import Figure

    from pbkv.bench import report

    def too_large(self, path, **kw):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(Figure, "savefig", too_large)
    records = [{"workload": "hover", "policy": "lru", "concurrency": 2, "device_tokens": 100,
                "mean_workflow_latency_s": 1.0, "device_hit_rate": 0.5}]
    with pytest.raises(OSError) as e:
        report.write_plots(records, tmp_path)
    assert str(e.value) == f"{tmp_path / 'hover.png'}: cannot write (File too large)"
