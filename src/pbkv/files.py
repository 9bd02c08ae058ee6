"""Files the user names: read as UTF-8 text with a clear error, written whole or not at all.

This module sits below every layer (it imports nothing from pbkv but `stale`).
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pbkv.stale import remove_stale


class CannotWrite(OSError):
    """An OSError whose message already names the file and says it cannot be written (callers
    adding the path to an OSError's message leave this one as it is)."""


def is_text(s: str) -> bool:
    """Whether `s` is Unicode text a UTF-8 file can hold: no lone surrogate such as "\\ud800",
    which a JSON escape can produce and which no later write or read of the file would accept."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_text(path: str | Path, where: str | None = None, error: type[Exception] = ValueError) -> str:
    """The file's text. A file that is not UTF-8 or cannot be read raises `error` naming
    `where` (default: the path) and, for bad UTF-8, the first bad byte and its offset."""
    where = where or str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror or e})") from None


def _temporary_name(path: Path, pid: int | str, tag: str) -> str:
    return f".{path.name}.{pid}-{tag}{path.suffix}"


@contextmanager
def replaced_on_success(path: str | Path) -> Iterator[Path]:
    """A temporary file beside `path` (same suffix) that replaces `path` when the block ends
    without an error and is removed otherwise: `path` is the old file or the whole new one, never
    half of one. The temporary name is hidden and carries the writer's PID
    (`.NAME.<pid>-<8 hex>SUFFIX`): a writer killed outright leaves it behind, and the next write
    to the same path removes it (`pbkv.stale`; never a live writer's).

    A symlink is written through (its target is replaced, the link stays); a file that is
    neither regular nor a folder (`/dev/null`, a FIFO) is written directly, as a shell would;
    a replaced file keeps its permission bits."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name")
    if path.exists() and not path.is_file():    # both follow symlinks: /dev/stdout is a pipe's
        yield path
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else None
    pattern = re.escape(_temporary_name(path, "PID", "TAG")).replace("PID", r"(?P<pid>\d+)").replace("TAG", "[0-9a-f]{8}")
    remove_stale(path.parent, pattern)
    # created with open(.., "x"), not mkstemp: the file gets the umask's mode (mkstemp's is 0600)
    tmp = path.parent / _temporary_name(path, os.getpid(), uuid.uuid4().hex[:8])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(tmp, "x").close()
        if mode is not None:
            os.chmod(tmp, mode)
    except OSError as e:  # name the file asked for, not the temporary one
        raise CannotWrite(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
