"""Leftovers of killed processes: folders and files that carry their owner's PID in the name.

A process that dies by kill -9 runs no cleanup, so whatever it was writing stays behind. Every
such temporary name here embeds the owner's PID; the next process to use the place removes
the entries whose owner is no longer alive (never a live owner's: it may still be writing).
This module sits below every layer (it imports nothing from pbkv).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


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


def remove_stale(folder: str | Path, pattern: str | re.Pattern) -> list[Path]:
    """Remove the entries of `folder` whose name fully matches `pattern` (a regex with a group
    named `pid`) and whose PID is not alive. Returns what was removed; errors are ignored
    (another process may be cleaning the same folder)."""
    regex = re.compile(pattern)
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = regex.fullmatch(entry.name)
        if m is None or pid_alive(int(m.group("pid"))):
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
