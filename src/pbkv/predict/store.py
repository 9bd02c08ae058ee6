"""Atomic, versioned saves of a predictor directory.

Layout of a saved directory DIR:
- `DIR/CURRENT`: one line, the name of the live version (`v000003`);
- `DIR/v000003/`: that version's files, complete;
- `DIR/.v000004.tmp<PID>/`, `DIR/CURRENT.tmp<PID>`: a save in progress by process PID;
- `DIR/.lock`: held (flock) by the save in progress, so saves by several processes (two servers
  sharing one `--predictor` folder) run one after the other.

Invariants:
- a save writes a whole new version under a temporary name, renames it to its version name
  (one rename: the version appears complete or not at all), then replaces `CURRENT` (os.replace
  of a one-line file, also atomic); so whatever instant a writer is killed at, `CURRENT` names
  a complete version: the old one, or the new one;
- a reader resolves `CURRENT` once and reads only that version: old or new, never a mix;
- the next save removes stale temporaries (their PID is dead) and every predictor version but
  two: the new one, and the one `CURRENT` named when the save began (the previous live one: a
  reader may still be loading it), whatever their numbers. After a rollback (`CURRENT` pointed
  by hand at an older version) the next save keeps the version rolled back to, not a higher
  numbered one. With no previous live version (a first save), the newest older version is kept
  instead (a first save killed before its pointer left it complete);
- a save never runs inside a version folder of a predictor folder: a target that is
  `DIR/v000003` or lies below it (where `DIR/CURRENT` names a version) is refused, since
  migrating its flat files would delete the live version of DIR (and a version's prune would
  take a predictor saved below it along); other folders under DIR are allowed; `_prune` also
  never removes the files of a folder its parent's `CURRENT` names;
- saves never interleave (`DIR/.lock`): two unlocked saves could each prune the other's
  version, leaving `CURRENT` naming a removed folder;
- a directory without `CURRENT` is one flat version (the layout before versioning); the first
  versioned save removes its files; one holding only predictor versions (a first save killed
  before its pointer) holds no predictor yet, and the next save goes on from there;
- a save touches only what is a predictor's: it runs only in a folder that is new, empty, a flat
  predictor or one whose `CURRENT` names a version folder holding a predictor (a LevelDB folder
  also has a `CURRENT`), and it removes only version folders holding a predictor's `config.json`;
  an entry of another kind whose name looks like a version is never removed and its number is
  skipped;
- whatever would make a save fail after the work (`.lock` not a writable regular file, a folder
  that cannot be written, a dangling symlink on the path, a file above it) is refused by
  `check_target`, which commands call before any work.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pbkv.stale import remove_stale

log = logging.getLogger("pbkv.predict")

POINTER = "CURRENT"
VERSION_NAME = re.compile(r"v(\d{6,})")
STALE = r"(\.v\d+\.tmp|CURRENT\.tmp)(?P<pid>\d+)"
LOCK = ".lock"
# workflows.json is history.FILE (history imports this module); a save merges it into the new
# version first (history.merge_with_live reads the live folder, here the flat one)
FLAT_FILES = ("model.safetensors", "markov.json", "workflows.json", "config.json")  # config.json last: see _prune
FLAT_FORMAT = "pbkv-predictor"               # config.json's "format" (predictor.FORMAT)


def on_step(step: str) -> None:
    """Called after each step of a save (tests replace it to kill a writer at that point)."""


def live_dir(path: str | Path) -> Path:
    """The folder holding the live version's files (`path` itself for a flat directory)."""
    path = Path(path)
    pointer = path / POINTER
    if not pointer.is_file():
        return path
    name = _read_pointer(pointer)
    if not VERSION_NAME.fullmatch(name):
        raise ValueError(f"{pointer}: expected a version name like v000001, got {name[:40]!r}")
    return path / name


def _read_pointer(pointer: Path) -> str:
    """`CURRENT`'s text, stripped. Only its head is read: a foreign file named CURRENT may be big,
    and a version name is short."""
    with open(pointer, "rb") as f:
        return f.read(64).decode("ascii", errors="replace").strip()


def has_predictor(path: str | Path) -> bool:
    """True when `path` holds a saved predictor (a version pointer, or a flat `config.json`)."""
    path = Path(path)
    return (path / POINTER).is_file() or (path / "config.json").is_file()


def check_target(path: str | Path) -> None:
    """Raise ValueError unless `path` may receive a save: it does not exist, is an empty folder,
    or holds a saved predictor (`_saved_predictor`), and a save there cannot fail on its lock file
    or permissions. A save removes older versions' folders and a flat layout's files, so it must
    never run in a folder of other files (a user's `config.json`, a LevelDB folder's `CURRENT`)."""
    path = Path(path)
    store = enclosing_store(path)
    if store is not None:
        raise ValueError(f"{path} is inside a version folder of the predictor folder {store}; a save there "
                         f"would delete or lose files of {store}'s versions: give {store} itself")
    if not path.exists():
        _check_new(path)
        return
    if not path.is_dir():
        raise ValueError(f"{path} is a file; give a folder for the predictor")
    if not _saved_predictor(path):
        others = sorted(e.name for e in path.iterdir() if not _ours(path, e.name))
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise ValueError(f"{path}: holds other files ({shown}) and no saved predictor; a save replaces "
                             f"files there, so give a new or empty folder")
    if not os.access(path, os.W_OK | os.X_OK):   # first: on a read-only folder, `.lock` cannot be fixed
        raise ValueError(f"{path}: cannot write in this folder (read-only or permission denied)")
    problem = _lock_problem(path / LOCK)
    if problem:
        raise ValueError(f"{path / LOCK}: {problem}; remove it (a save creates it as an empty file)")


def _check_new(path: Path) -> None:
    """A folder a save will create (`mkdir(parents=True)`): refuse what makes that fail after the
    work: a dangling symlink on the path (mkdir raises "File exists" on it), a file above it,
    or a nearest existing folder that cannot be written."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            raise ValueError(f"{p} is a symlink to a missing folder ({os.readlink(p)}); create that folder "
                             f"or give another path for the predictor")
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"{p} is a file; cannot create the predictor folder {path} under it")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ValueError(f"{p}: cannot create the predictor folder {path} there (read-only or "
                                 f"permission denied)")
            return


def enclosing_store(path: str | Path) -> Path | None:
    """The versioned predictor folder whose version folder `path` is or lies inside (`STORE/v000003`
    or below, where `STORE/CURRENT` names a version holding a predictor), or None. A save there
    would migrate or prune that version's files, or be pruned with it. Other folders under a
    store (`STORE/results`) are not inside a version. Both the path as written, with `..` folded
    (`STORE/../other` is beside STORE), and its resolved form (a symlink into a store) are checked."""
    path = Path(path)
    for form in (Path(os.path.normpath(path.absolute())), path.resolve()):
        for version in (form, *form.parents):
            store = version.parent
            if (VERSION_NAME.fullmatch(version.name) and (store / POINTER).is_file()
                    and _saved_predictor(store)):
                return store
    return None


def _is_live_version(path: Path) -> bool:
    """`path` is the folder its parent's `CURRENT` names: its files are a live predictor's."""
    pointer = path.parent / POINTER
    try:
        return pointer.is_file() and _read_pointer(pointer) == path.name
    except OSError:
        return True   # unreadable pointer: assume the worst, never delete


def _ours(path: Path, name: str) -> bool:
    """An entry a save leaves in a folder before its pointer exists: a stale temporary, the lock,
    or a complete predictor version (a first save killed between its rename and its pointer)."""
    return (re.fullmatch(STALE, name) is not None or name == LOCK
            or (VERSION_NAME.fullmatch(name) is not None and _is_predictor_folder(path / name)))


def _saved_predictor(path: Path) -> bool:
    """`path` is a flat predictor, or its `CURRENT` names a version folder holding a predictor."""
    if not (path / POINTER).is_file():
        return _is_predictor_folder(path)
    try:
        name = _read_pointer(path / POINTER)
    except OSError:
        return False
    return VERSION_NAME.fullmatch(name) is not None and _is_predictor_folder(path / name)


def _is_predictor_folder(path: Path) -> bool:
    """`path/config.json` is a predictor's (a version's, or the flat layout's), not any JSON file."""
    config = path / "config.json"
    if not config.is_file():   # a FIFO named config.json must not block the check
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FLAT_FORMAT


def _lock_problem(lock: Path) -> str | None:
    """What stops a save from locking `lock`, or None (absent is fine: the save creates it)."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder, not a lock file"
    if not stat.S_ISREG(st.st_mode):   # a FIFO would block the save forever in open()
        return "is not a regular file (a FIFO, socket or device)"
    try:
        os.close(os.open(lock, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as e:
        return f"cannot be opened for writing ({e.strerror or e})"
    return None


def _versions(path: Path) -> list[tuple[int, str]]:
    """(number, name) of the version folders holding a predictor, oldest first: the only ones
    a save may remove."""
    return [(n, name) for n, name in _numbers(path) if _is_predictor_folder(path / name)]


def _numbers(path: Path) -> list[tuple[int, str]]:
    """(number, name) of every entry named like a version, of any kind, sorted: a new version
    takes a number above all of them, so it never lands on a user's file or folder."""
    out = []
    for entry in path.iterdir():
        m = VERSION_NAME.fullmatch(entry.name)
        if m:
            out.append((int(m.group(1)), entry.name))
    return sorted(out)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_version(path: Path, write: Callable[[Path], None]) -> str:
    """Write a complete new version beside the live one; return its name (not yet live).
    An OSError names the version being saved, not its temporary folder."""
    pid = os.getpid()
    while True:
        numbers = _numbers(path)
        name = f"v{(numbers[-1][0] if numbers else 0) + 1:06d}"
        tmp = path / f".{name}.tmp{pid}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            write(tmp)
            for f in tmp.iterdir():
                _fsync(f)
            on_step("written")
            os.rename(tmp, path / name)  # fails when another writer took this name first
            return name
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.lexists(path / name):   # taken meanwhile: the next pass takes a higher number
                continue
            raise OSError(f"{path / name}: cannot save ({e.strerror or e})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _point_to(path: Path, name: str) -> None:
    tmp = path / f"{POINTER}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / POINTER)


def _prune(path: Path, live: str, before: str | None) -> None:
    """Drop every predictor version but `live` (just made live) and `before` (the one `CURRENT`
    named when this save began: a reader may still be loading it); without `before`, the newest
    older version stays in its place. Also drop a flat layout's files (only when they are a
    predictor's and not the live version of a store above: `config.json` is removed last, so a
    prune killed midway leaves them recognisable and the next save finishes it)."""
    live_number = int(VERSION_NAME.fullmatch(live).group(1))
    older = [name for n, name in _versions(path) if n < live_number]
    keep = {live, before if before is not None else (older[-1] if older else None)}
    for name in older:
        if name not in keep:
            shutil.rmtree(path / name, ignore_errors=True)
    if _is_predictor_folder(path) and not _is_live_version(path):
        for f in FLAT_FILES:
            (path / f).unlink(missing_ok=True)


def _live_name(path: Path) -> str | None:
    """The version `CURRENT` names now, or None (no pointer, or not a version name)."""
    try:
        name = _read_pointer(path / POINTER)
    except OSError:
        return None
    return name if VERSION_NAME.fullmatch(name) else None


def publish(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Save a new version of `path` with `write(folder)` (which fills an empty folder) and make
    it live atomically. Returns `path`. Waits for a save in progress by another process."""
    path = Path(path)
    check_target(path)
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        remove_stale(path, STALE)
        # the sibling temp folder of the earlier save (`.NAME.tmp<PID>`), left by a killed writer
        remove_stale(path.parent, re.escape(f".{path.name}.tmp") + r"(?P<pid>\d+)")
        before = _live_name(path)   # read under the lock: no other save moves it until we are done
        name = _write_version(path, write)
        on_step("renamed")
        _point_to(path, name)
        # live from here on: what fails now is tidying up, not the save (reported as failed, its
        # caller would count its workflows as unsaved and save them again beside these)
        try:
            on_step("pointed")
            _fsync(path)
            _prune(path, name, before)
        except OSError as e:
            log.warning("%s: saved as %s (live), but tidying up after it failed: %s", path, name, e)
    return path


@contextmanager
def _locked(path: Path):
    """Hold `path/.lock` exclusively. flock is released by the kernel when its holder dies, so a
    killed writer never blocks the next save; the file itself stays (removing it would let two
    writers lock two different files). Opened with O_NONBLOCK, which keeps open() from waiting
    for a reader when `.lock` is a FIFO (flock still waits for another writer: LOCK_NB is unset);
    anything but a regular file is refused."""
    lock = path / LOCK
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise OSError(f"{lock}: {_lock_problem(lock) or f'cannot open ({e.strerror or e})'}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{lock}: is not a regular file (a FIFO, socket or device); remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the flock
