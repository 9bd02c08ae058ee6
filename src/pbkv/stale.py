"""Leftovers of killed processes: folders and files that carry their owner's PID in the name.

A process that dies by kill -9 runs no cleanup, so whatever it was writing stays behind. Every
such temporary name here embeds the owner's PID; the next process to use the place removes
the entries whose owner is no longer alive (never a live owner's: it may still be writing).

A PID names a process only within its PID namespace: two containers sharing one volume see
each other's PIDs as dead (or as someone else). So a folder that lives long (a disk tier's) is
also marked with `hold`: an flock on `OWNER` inside it, kept for the owner's life (the kernel
drops it when the process ends, however it ends; flock works across namespaces on one host).
`remove_stale(..., marked=True)` (for such folders) never removes one whose mark is locked,
nor one younger than `GRACE_S` without a mark (its owner may be between creating it and
locking it).
This module sits below every layer (it imports nothing from pbkv).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from pathlib import Path

OWNER = ".owner"   # the lock file `hold` puts in a folder
GRACE_S = 60.0     # a folder without a lock file this young may be one its owner has not locked yet


def hold(folder: str | Path) -> int:
    """Mark `folder` as this process's for its life (see the module docstring): the open,
    flocked descriptor of `folder/OWNER` (closing it ends the mark)."""
    fd = os.open(Path(folder) / OWNER, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _held(entry: Path) -> bool:
    """Whether a live process may own `entry`, whatever its PID says: its `OWNER` lock is held
    by someone, or it is a folder too young to have one yet."""
    try:
        fd = os.open(entry / OWNER, os.O_RDWR | os.O_CLOEXEC)
    except NotADirectoryError:
        return False
    except OSError:
        try:
            return entry.is_dir() and time.time() - entry.stat().st_mtime < GRACE_S
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True while a process with this PID runs (a zombie, dead but not yet reaped, is not alive)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:  # Linux: the state follows the parenthesised command name in /proc/PID/stat
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"


def remove_stale(folder: str | Path, pattern: str | re.Pattern, marked: bool = False) -> list[Path]:
    """Remove the entries of `folder` whose name fully matches `pattern` (a regex with a group
    named `pid`) and whose PID is not alive; with `marked` (entries made by owners that `hold`
    them), also only those no live process holds (`_held`). Returns what was removed; errors
    are ignored (another process may be cleaning the same folder)."""
    regex = re.compile(pattern)
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = regex.fullmatch(entry.name)
        if m is None or pid_alive(int(m.group("pid"))) or (marked and _held(entry)):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed
