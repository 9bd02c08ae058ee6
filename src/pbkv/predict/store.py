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
- the next save removes stale temporaries (their PID is dead) and every version but the live
  one and the one before it (a reader may still be loading that);
- saves never interleave (`DIR/.lock`): two unlocked saves could each prune the other's
  version, leaving `CURRENT` naming a removed folder;
- a directory without `CURRENT` is one flat version (the layout before versioning); the first
  versioned save removes its files.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pbkv.stale import remove_stale

POINTER = "CURRENT"
VERSION_NAME = re.compile(r"v(\d{6,})")
STALE = r"(\.v\d+\.tmp|CURRENT\.tmp)(?P<pid>\d+)"
LOCK = ".lock"
FLAT_FILES = ("config.json", "model.safetensors", "markov.json")
FLAT_FORMAT = "pbkv-predictor"               # config.json's "format" (predictor.FORMAT)


def on_step(step: str) -> None:
    """Called after each step of a save (tests replace it to kill a writer at that point)."""


def live_dir(path: str | Path) -> Path:
    """The folder holding the live version's files (`path` itself for a flat directory)."""
    path = Path(path)
    pointer = path / POINTER
    if not pointer.is_file():
        return path
    name = pointer.read_text(encoding="ascii", errors="replace").strip()
    if not VERSION_NAME.fullmatch(name):
        raise ValueError(f"{pointer}: expected a version name like v000001, got {name[:40]!r}")
    return path / name


def has_predictor(path: str | Path) -> bool:
    """True when `path` holds a saved predictor (a version pointer, or a flat `config.json`)."""
    path = Path(path)
    return (path / POINTER).is_file() or (path / "config.json").is_file()


def check_target(path: str | Path) -> None:
    """Raise ValueError unless `path` may receive a save: it does not exist, is an empty folder,
    or holds a saved predictor. A save removes older versions' folders and a flat layout's files,
    so it must never run in a folder of other files (a user's `config.json`, say)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path} is a file; give a folder for the predictor")
    if (path / POINTER).is_file() or _flat_predictor(path):
        return
    others = sorted(e.name for e in path.iterdir() if not re.fullmatch(STALE, e.name) and e.name != LOCK)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ValueError(f"{path}: holds other files ({shown}) and no saved predictor; a save replaces "
                         f"files there, so give a new or empty folder")


def _flat_predictor(path: Path) -> bool:
    """`path/config.json` is a predictor's (the layout before versioning), not any JSON file."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("format") == FLAT_FORMAT


def _versions(path: Path) -> list[tuple[int, str]]:
    out = []
    for entry in path.iterdir():
        m = VERSION_NAME.fullmatch(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), entry.name))
    return sorted(out)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_version(path: Path, write: Callable[[Path], None]) -> str:
    """Write a complete new version beside the live one; return its name (not yet live)."""
    pid = os.getpid()
    while True:
        name = f"v{(_versions(path)[-1][0] if _versions(path) else 0) + 1:06d}"
        tmp = path / f".{name}.tmp{pid}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write(tmp)
            for f in tmp.iterdir():
                _fsync(f)
            on_step("written")
            os.rename(tmp, path / name)  # fails when another writer took this name first
            return name
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if (path / name).is_dir():
                continue
            raise
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
    _fsync(path)


def _prune(path: Path, live: str) -> None:
    """Drop versions older than the one before `live`, and a flat layout's files."""
    names = [n for _, n in _versions(path)]
    keep = {live}
    older = [n for n in names if n < live]
    if older:
        keep.add(older[-1])
    for n in names:
        if n not in keep:
            shutil.rmtree(path / n, ignore_errors=True)
    for f in FLAT_FILES:
        (path / f).unlink(missing_ok=True)


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
        name = _write_version(path, write)
        on_step("renamed")
        _point_to(path, name)
        on_step("pointed")
        _prune(path, name)
    return path


@contextmanager
def _locked(path: Path):
    """Hold `path/.lock` exclusively. flock is released by the kernel when its holder dies, so a
    killed writer never blocks the next save; the file itself stays (removing it would let two
    writers lock two different files)."""
    with open(path / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
