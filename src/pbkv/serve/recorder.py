"""`--record DIR`: served calls written as v1 traces (docs/trace-format.md), in rotating files.

Each file is a complete, valid trace (`pbkv.trace.read_trace` accepts it): the metadata line, then
whole workflow runs, each written at once when the run ends, its calls in step order (steps
0..n-1), the last one with `done: true`. Lines come from `pbkv.trace.io`'s serialisers. A run's
lines go to the file in one unbuffered `write` call, so a server killed at any moment (kill -9)
leaves every finished file whole and the current one whole up to its last run but one: the
kernel may stop a large write between pages when the process is killed, so the run being
written can be cut (`read_trace` then names the file and the cut line). A file is closed and
the next begun after `rotate_calls` calls, so `pbkv train --trace DIR/*.jsonl` can use finished
files while the server keeps recording.

Block ids come from the prompt's token ids (`pbkv.engine.hf.tokens.block_hashes`: chained, as
docs/trace-format.md requires). File names are `calls-<session>-<n>.jsonl`, made only from the server's
own session id and a counter: nothing a client sends ever reaches a path. Workflow ids written are
the server's `record_id`s, so two runs under one client id never collide in a file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import replace
from pathlib import Path

from pbkv.trace import Call, TraceMeta
from pbkv.trace.io import call_to_dict, meta_to_dict

log = logging.getLogger(__name__)


class TraceRecorder:
    def __init__(self, folder: str | Path, session: str, block_size: int, model: str,
                 rotate_calls: int = 10_000):
        if rotate_calls < 1:
            raise ValueError(f"rotate size must be >= 1 call, got {rotate_calls}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.session, self.block_size, self.model = session, block_size, model
        self.rotate_calls = rotate_calls
        self.files: list[Path] = []
        self.calls = 0
        self._in_file = 0
        self._fh = None
        self._lock = threading.Lock()  # written from the engine thread, closed from the main one

    def record(self, calls: list[Call]) -> bool:
        """Write one ended run (its calls, any order; written sorted by step and numbered 0..n-1:
        a call the server left out, never served, leaves no gap). False when it could not be
        written (disk full, folder removed: logged); the file is then cut back to its last whole
        run, or, if even that fails, closed and the next run starts a new file, so every file
        stays a valid trace."""
        if not calls:
            return True
        calls = [replace(c, step=i) for i, c in enumerate(sorted(calls, key=lambda c: c.step))]
        calls[-1].done = True
        text = "".join(json.dumps(call_to_dict(c), separators=(",", ":")) + "\n" for c in calls)
        with self._lock:
            try:
                if self._fh is None or self._in_file >= self.rotate_calls:
                    self._open()
            except OSError as e:
                self._fh = None
                log.error("--record: cannot start a trace file in %s (%s); run %s not recorded",
                          self.folder, e.strerror or e, calls[0].workflow_id)
                return False
            start = self._fh.tell()
            try:
                _write_all(self._fh, text.encode("utf-8"))
            except OSError as e:
                log.error("--record: cannot write run %s to %s (%s); not recorded",
                          calls[0].workflow_id, self.files[-1], e.strerror or e)
                self._cut_back(start)
                return False
            self._in_file += len(calls)
            self.calls += len(calls)
        return True

    def _cut_back(self, size: int) -> None:
        """Drop a partly written run (the file ends with its last whole run again); if the file
        cannot be cut, leave it and write the next run to a new one."""
        try:
            os.ftruncate(self._fh.fileno(), size)
            os.lseek(self._fh.fileno(), size, os.SEEK_SET)
        except OSError:
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def _open(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.folder.mkdir(parents=True, exist_ok=True)   # removed while serving: made again
        path = self.folder / f"calls-{self.session}-{len(self.files):05d}.jsonl"
        self._fh = open(path, "wb", buffering=0)
        self.files.append(path)
        meta = TraceMeta(block_size=self.block_size, source=f"pbkv serve ({self.model})",
                         notes="served calls; hash_ids are chained hashes of the prompt's token ids")
        try:
            _write_all(self._fh, (json.dumps(meta_to_dict(meta), separators=(",", ":")) + "\n").encode("utf-8"))
        except OSError:
            self._fh.close()
            self._fh = None
            path.unlink(missing_ok=True)   # a header cut short is no trace
            self.files.pop()
            raise
        self._in_file = 0


def _write_all(fh, data: bytes) -> None:
    """One `write` system call for the whole of `data` (a regular file takes it whole unless the
    disk is full or the process is killed mid-copy; the loop covers a short write)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fh.fileno(), view):]
