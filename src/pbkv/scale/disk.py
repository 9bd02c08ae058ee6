"""Ownership of the per-replica `--disk-dir` subfolders (`replica-<id>`, see `pbkv.scale.replica`).

A replica that is SIGKILLed (or frozen, then killed by Ray) never runs its shutdown, so its
subfolder, with its disk tier's files, would stay forever: replica ids are never reused. So each
replica marks its subfolder as owned before the engine creates it, and every new replica removes
the subfolders whose owner is gone (`sweep`).

The mark is `replica-<id>.lock` next to the folder, `flock`ed by the owner for its whole life (the
kernel drops the lock when the process ends, however it ends). Invariants:
- the lock file appears already locked: it is created and locked under a temporary name, then
  renamed (a sweeper can never take the lock of an owner that has not locked it yet);
- a folder is removed only while its lock file is locked by the sweeper, and is still the file at
  that name (not one unlinked by another sweeper meanwhile), and was written by this host (a lock
  on a filesystem shared by several nodes may not be seen by the others);
- the sweeper removes the folder before the lock file, so a folder whose lock file is gone was
  either ended cleanly (its owner left it non-empty on purpose) or not made by this code: it is
  never touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket

log = logging.getLogger("pbkv.scale")
PREFIX, SUFFIX = "replica-", ".lock"
MAX_SWEEP = 32   # stale folders removed per replica start (each start removes more, if there are more)


def folder(disk_dir: str, replica_id: str) -> str:
    return os.path.join(disk_dir, f"{PREFIX}{replica_id}")


def claim(disk_dir: str, replica_id: str) -> int:
    """Lock `replica-<id>.lock` in `disk_dir` for this process's life; the open descriptor (keep
    it open: closing it ends the claim)."""
    os.makedirs(disk_dir, exist_ok=True)
    temp = os.path.join(disk_dir, f".{PREFIX}{replica_id}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_CREAT | os.O_RDWR | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        os.rename(temp, folder(disk_dir, replica_id) + SUFFIX)
    except BaseException:
        os.close(fd)
        _unlink(temp)
        raise
    return fd


def release(disk_dir: str, replica_id: str, fd: int) -> None:
    """The owner's clean end: its lock file goes, then the lock (a sweeper that opened the file
    before the unlink finds it unlinked once it gets the lock, and leaves it)."""
    _unlink(folder(disk_dir, replica_id) + SUFFIX)
    os.close(fd)


def sweep(disk_dir: str, limit: int = MAX_SWEEP) -> list[str]:
    """Remove the subfolders of `disk_dir` whose owner is gone (at most `limit`, oldest names
    first); the folders removed. Never raises: a failure leaves that folder for a later sweep."""
    try:
        names = sorted(n for n in os.listdir(disk_dir) if n.startswith(PREFIX) and n.endswith(SUFFIX))
    except OSError:
        return []
    removed = []
    for name in names:
        if len(removed) >= limit:
            log.warning("%s: removed %d stale replica folders; the rest wait for the next replica start",
                     disk_dir, limit)
            break
        path = os.path.join(disk_dir, name)
        try:
            if _remove_if_orphan(path):
                removed.append(path[:-len(SUFFIX)])
        except OSError as exc:
            log.warning("could not remove the stale replica folder of %s: %r", path, exc)
    return removed


def _remove_if_orphan(lock_path: str) -> bool:
    """Remove the folder of `lock_path`, then the lock file, when no process holds its lock."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:   # ended, or swept by another replica meanwhile
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:   # its owner lives
            return False
        if not _same_file(fd, lock_path) or not _this_host(fd):
            return False
        target = lock_path[:-len(SUFFIX)]
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.unlink(lock_path)
        # a warning, not info: Ray workers show warnings by default, and it means a replica was killed
        log.warning("removed %s: its replica is gone (killed before its shutdown)", target)
        return True
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _this_host(fd: int) -> bool:
    owner = os.pread(fd, 4096, 0).decode(errors="replace").split()
    return bool(owner) and owner[0] == socket.gethostname()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
