"""JSON that refuses a key written twice: `json.loads` keeps the last one silently, so a value
corrected above a stale one would be lost without a word. Used for the small files a user writes
by hand (spec files, profiles, a predictor's config.json and markov.json); the error names the
line of the repeated key.

This module sits below every layer (it imports nothing from pbkv).
"""

from __future__ import annotations

import json
from json.decoder import WHITESPACE, JSONObject, scanstring
from json.scanner import py_make_scanner
from typing import Any

SHOWN = 60   # characters of a repeated key's repr in the message


class DuplicateKey(json.JSONDecodeError):
    """A key written twice in one object; `key` is the key, `lineno` its second occurrence's line."""

    def __init__(self, key: str, doc: str, pos: int):
        shown = repr(key)
        super().__init__(f"duplicate key {shown if len(shown) <= SHOWN else shown[:SHOWN - 3] + '...'}", doc, pos)
        self.key = key


def loads(text: str) -> Any:
    """`json.loads(text)`, but a repeated key raises `DuplicateKey` (a `json.JSONDecodeError`).

    json's C scanner reads the text; only a text with a repeated key is read again by the
    pure-Python one (~15x slower: a 1,000-agent markov.json took 1.1 s), to find the key's line."""
    try:
        return json.loads(text, object_pairs_hook=_no_repeats)
    except _Repeated:
        return _Decoder().decode(text)   # raises DuplicateKey, at the repeated key


class _Repeated(Exception):
    """A repeated key, seen by the C scanner (which gives no position)."""


def _no_repeats(pairs: list) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _Repeated
    return value


def _key_offset(s: str, start: int, index: int, strict: bool, scan_once) -> int:
    """Offset of the `index`-th key of the (already parsed, so well-formed) JSON object at `start`."""
    pos = start
    for _ in range(index):
        _, pos = scanstring(s, WHITESPACE.match(s, pos).end() + 1, strict)
        _, pos = scan_once(s, WHITESPACE.match(s, WHITESPACE.match(s, pos).end() + 1).end())
        pos = WHITESPACE.match(s, pos).end() + 1  # past the ','
    return WHITESPACE.match(s, pos).end()


def _unique_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
    """json's object parser, refusing a repeated key (at the repeated key's offset)."""
    s, start = s_and_end
    pairs, end = JSONObject(s_and_end, strict, scan_once, None, list, memo)
    seen = set()
    for i, (key, _) in enumerate(pairs):
        if key in seen:
            raise DuplicateKey(key, s, _key_offset(s, start, i, strict, scan_once))
        seen.add(key)
    return dict(pairs), end


class _Decoder(json.JSONDecoder):
    def __init__(self):
        super().__init__()
        self.parse_object = _unique_object
        self.scan_once = py_make_scanner(self)  # the C scanner would not call parse_object
