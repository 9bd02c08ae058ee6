"""Files the user names: read as UTF-8 text with a clear error, written whole or not at all.

This module sits below every layer (it imports nothing from pbkv but `stale`).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
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


def check_output_file(path: Path) -> None:
    """Raise ValueError unless `path` can be written as a file: checked before any work, so that a
    run does not train or measure for minutes and then fail to write its result. Its folder must
    be writable or creatable (`check_writable`); a path that is neither a regular file nor a
    folder (`/dev/null`, `/dev/stdout`) is written directly and not checked further."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name")
    check_no_file_above(path)
    if not (path.exists() and not path.is_file()):
        check_writable(path.parent, path)   # the file is written as a temporary file there, then renamed


def check_output_folder(path: Path) -> None:
    """Raise ValueError unless `path` is, or can be made, a folder files can be written in."""
    check_readable_folder(path)
    check_writable(path, path)


def check_readable_folder(path: Path) -> None:
    """Raise ValueError if `path` is a file or cannot be a folder (a file above it); it need not
    be writable (a folder a command can use read-only)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; give a folder")
    check_no_file_above(path)


def check_no_file_above(path: Path) -> None:
    for above in path.parents:
        if above.exists() and not above.is_dir():
            raise ValueError(f"{above} is a file, so {path} cannot be written")


def check_writable(folder: Path, output: Path) -> None:
    """Raise ValueError unless `folder` (where `output` goes) is, or can be made, a folder this
    process can create files in: the nearest existing folder on its path gets an empty temporary
    folder, removed at once (`os.access` is not enough: root passes it for `/proc`, where nothing
    can be created). Nothing is left behind: no folder on the way is created here."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return   # a file above: `check_no_file_above` says so; no existing folder at all: mkdir will say
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pbkv-write-check-", dir=existing))
    except OSError as e:
        made = "" if existing == folder else f", so {folder} cannot be made"
        raise ValueError(f"cannot write {output}: cannot create files in {existing}{made} "
                         f"({e.strerror or e})") from None


def write_tensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to `path` as a safetensors file (the bytes `save_file` writes) whose mode
    follows the umask, as every other file pbkv writes (0644 under umask 022): safetensors'
    `save_file` creates its files 0600 whatever the umask, so another account's process (a
    server loading a predictor, a replica reading the shared KV tier) could not read them."""
    from safetensors.torch import save   # here: most commands never write tensors (torch is slow to import)
    Path(path).write_bytes(save(tensors, metadata=metadata))


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
