"""The lines of a trace file, decoded, with every way reading can fail turned into `TraceError`.

`read_lines(path)` yields (line number, text, parsed JSON value) and raises `TraceError` whose
message starts with `FILE` or `FILE:LINE` for: a missing file, a folder, an unreadable file, a
`.gz` that is not gzip, corrupt or truncated gzip data, bytes that are not UTF-8 (UTF-16 files
included), lines that are not JSON, JSON nested too deep or with integers too long to convert,
an object with a key written twice (`json.loads` would keep the last one silently), and strings
holding lone surrogates (`"\\ud800"`: valid JSON, but not text any UTF-8 file or
terminal can hold). No other exception escapes for any file content.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import IO, Iterator

from pbkv import unique_json
from pbkv.files import is_text

UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class TraceError(ValueError):
    """A trace violates TRACE_FORMAT v1. The message names file, line, field and value."""


def display_name(path: Path) -> str:
    """`path` as printable text (undecodable bytes of a file name shown as \\x escapes)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _open_binary(path: Path, name: str) -> IO[bytes]:
    if path.is_dir():
        raise TraceError(f"{name}: is a folder, not a trace file")
    if not path.exists():
        raise TraceError(f"{name}: no such trace file")
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise TraceError(f"{name}: cannot open ({e.strerror or e})") from None
    if path.suffix != ".gz":
        return raw
    return gzip.GzipFile(filename="", mode="rb", fileobj=raw)


def _read_error(name: str, line: int, e: BaseException) -> TraceError:
    where = f"{name}:{line}"
    if isinstance(e, gzip.BadGzipFile) and str(e).startswith("Not a gzipped file"):
        return TraceError(f"{where}: not valid gzip data, though the name ends in .gz ({e})")
    if isinstance(e, (zlib.error, gzip.BadGzipFile)):  # bad deflate data, CRC or length
        return TraceError(f"{where}: corrupt gzip data ({e})")
    if isinstance(e, EOFError):
        return TraceError(f"{where}: the gzip data ends early (a truncated file?)")
    return TraceError(f"{where}: cannot read ({getattr(e, 'strerror', None) or e})")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if raw.startswith(UTF16_BOMS):
            raise TraceError(f"{where}: the file is UTF-16 (it starts with a byte-order mark); "
                             f"traces are UTF-8") from None
        raise TraceError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                         f"{e.start + 1})") from None


def _lone_surrogate(value) -> str | None:
    """The first string (key or value) in `value` holding a lone surrogate, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not is_text(v):
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


class _RepeatedKey(Exception):
    """Raised by `_pairs` with the repeated key; `parse_json` finds its column with `unique_json`."""


def _pairs(pairs: list) -> dict:
    """An object's key-value pairs as a dict, refusing a repeated key. (The C scanner calls this
    per object: much faster on long traces than `unique_json`'s pure-Python scanner.)"""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        raise _RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs)


def _repeated(text: str, key: str, where: str) -> TraceError:
    """The error for `key` written twice in `text`, with its column where it can be found (the
    pure-Python scanner that finds it recurses deeper than the C one: a deep line gets none)."""
    try:
        unique_json.loads(text)
    except unique_json.DuplicateKey as e:
        key, column = e.key, f" (column {e.colno})"
    except RecursionError:
        column = ""
    return TraceError(f"{where}: key {key!r} written twice{column}; which value counts would be left to chance")


def parse_json(text: str, where: str):
    """One line's JSON value; `TraceError` for anything that is not plain JSON text."""
    try:
        if text.startswith("\ufeff"):   # as json.loads does (JSONDecoder.decode does not check)
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        # without its line end: an error at the end of the line is placed there, not at
        # "column 1" of the next line (JSON's position counts lines too)
        value = _DECODER.decode(text.rstrip("\r\n"))
    except _RepeatedKey as e:
        raise _repeated(text, e.args[0], where) from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise TraceError(f"{where}: not valid JSON ({e})") from None
    if "\\u" in text or "\\U" in text:  # only an escape can produce a lone surrogate
        bad = _lone_surrogate(value)
        if bad is not None:
            raise TraceError(f"{where}: a string holds a lone surrogate (not valid Unicode text), "
                             f"got {bad[:40]!r}")
    return value


def _parse_line(text: str, where: str, cut: bool, pbkv: bool):
    """`parse_json`, saying so when the file ends inside this line (no newline after it), and for
    a pbkv trace (`pbkv`) how to keep what came before."""
    try:
        return parse_json(text, where)
    except TraceError as e:
        if not cut:
            raise
        repair = ": `pbkv trace repair FILE -o OUT` keeps the whole runs before it" if pbkv else ""
        raise TraceError(f"{e}; the file ends inside this line (its writer killed while writing?){repair}") from None


def read_lines(path: str | Path, name: str | None = None, pbkv: bool = True) -> Iterator[tuple[int, str, object]]:
    """Yield (line number, text, JSON value) for each non-blank line of a `.jsonl[.gz]` file;
    `pbkv=False` for a foreign trace (`pbkv trace repair` does not apply to it)."""
    path = Path(path)
    name = name or display_name(path)
    line = 0
    f = _open_binary(path, name)
    try:
        with f:
            while True:
                try:
                    raw = f.readline()
                except (OSError, EOFError, zlib.error) as e:
                    raise _read_error(name, line + 1, e) from None
                if not raw:
                    return
                line += 1
                where = f"{name}:{line}"
                text = _decode(raw, where)
                if text.strip():
                    yield line, text, _parse_line(text, where, not raw.endswith(b"\n"), pbkv)
    except (OSError, EOFError, zlib.error) as e:  # closing a gzip file can check its trailer
        raise _read_error(name, line + 1, e) from None
