"""Malformed trace files: every one is a `TraceError` naming FILE[:LINE], never another exception.

The named cases are the ones a hostile probe of `pbkv trace stats` found tracebacking; the sweep
mutates each line of a valid trace many ways (a mutation test of the reader: whatever the bytes,
`read_trace` returns a `Trace` or raises `TraceError` starting with the file name)."""

from __future__ import annotations

import gzip
import json
import random
import re
from collections import Counter

import pytest

from pbkv.trace import TraceError, read_trace

META = '{"pbkv_trace": 1, "block_size": 4}'
CALL = '{"workflow_id": "w", "step": 0, "agent": "a", "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}'
GOOD = f"{META}\n{CALL}\n"
LONG = META + "\n" + "".join(CALL.replace('"w"', f'"w{i}"') + "\n" for i in range(50))
AGENT_COLUMN = CALL.index('"a"') + 2
DEEP_AGENT = CALL.replace('"a"', "[" * 900 + "]" * 900)   # the agent a list nested 900 deep
SURROGATE_CALL = CALL.replace('"a"', '"\\ud800"')   # the JSON text "\ud800": valid JSON, not valid text


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


CASES = [  # (id, file name, content, expected message after "NAME")
    ("not-gzip", "t.jsonl.gz", GOOD.encode(), r":1: not valid gzip data, though the name ends in \.gz"),
    ("corrupt-deflate", "t.jsonl.gz", gz(GOOD.encode())[:10] + b"\xff" * 40, r":1: corrupt gzip data"),
    ("truncated-gz", "t.jsonl.gz", gz(LONG.encode())[:-30], r":\d+: the gzip data ends early"),
    ("bad-crc", "t.jsonl.gz", gz(GOOD.encode())[:-8] + b"\0\0\0\0" + gz(GOOD.encode())[-4:], r":\d+: corrupt gzip data \(CRC check failed"),
    ("xff-byte", "t.jsonl", f"{META}\n".encode() + CALL.encode().replace(b'"a"', b'"\xff"') + b"\n",
     rf":2: not UTF-8 text \(byte 0xff at column {AGENT_COLUMN}\)"),
    ("utf-16", "t.jsonl", GOOD.encode("utf-16"), r":1: the file is UTF-16"),
    ("nested-1000", "t.jsonl", f"{META}\n{'[' * 1000}{']' * 1000}\n".encode(), r":2: JSON nested too deeply"),
    ("nested-field", "t.jsonl", f"{META}\n{DEEP_AGENT}\n".encode(),
     r":2: field 'agent': expected a non-empty string, got "),
    ("lone-surrogate", "t.jsonl", f"{META}\n{SURROGATE_CALL}\n".encode(),
     r":2: a string holds a lone surrogate \(not valid Unicode text\), got '\\ud800'"),
    ("surrogate-key", "t.jsonl", f"{META}\n{CALL[:-1]}, \"\\udfff\": 1}}\n".encode(), r":2: a string holds a lone surrogate"),
    ("version-true", "t.jsonl", f'{{"pbkv_trace": true}}\n{CALL}\n'.encode(), r":1: field 'pbkv_trace': only trace format version 1"),
    ("version-float", "t.jsonl", f'{{"pbkv_trace": 1.0}}\n{CALL}\n'.encode(), r":1: field 'pbkv_trace': only trace format version 1"),
    ("huge-int", "t.jsonl", f"{META}\n{CALL.replace('8', '9' * 5000, 1)}\n".encode(), r":2: not valid JSON \(Exceeds the limit"),
    ("object-cut-short", "t.jsonl", f"{META}\n{CALL[:-1]}\n".encode(),   # the error is at the line's end
     rf":2: not valid JSON \(Expecting ',' delimiter at column {len(CALL)}\)"),
    ("nul-line", "t.jsonl", f"{META}\n\0\n".encode(), r":2: not valid JSON"),
    ("utf8-bom", "t.jsonl", b"\xef\xbb\xbf" + GOOD.encode(), r":1: not valid JSON \(Unexpected UTF-8 BOM"),
    ("repeated-key", "t.jsonl", f"{META}\n{CALL[:-1]}, \"agent\": \"b\"}}\n".encode(),
     rf":2: key 'agent' written twice \(column {len(CALL) + 2}\); which value counts would be left to chance"),
    ("repeated-meta-key", "t.jsonl", f'{{"pbkv_trace": 1, "block_size": 4, "block_size": 16}}\n{CALL}\n'.encode(),
     r":1: key 'block_size' written twice \(column 36\)"),
    ("repeated-nested-key", "t.jsonl", f'{META}\n{CALL[:-1]}, "x": [{{"k": 1, "k": 2}}]}}\n'.encode(),
     r":2: key 'k' written twice"),
]


@pytest.mark.parametrize("name, content, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_probe_case_is_a_file_line_trace_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert re.match(re.escape(str(path)) + message, str(err.value)), str(err.value)
    str(err.value).encode("ascii")  # printable on any terminal


def test_a_folder_and_a_missing_file(tmp_path):
    with pytest.raises(TraceError, match=re.escape(f"{tmp_path}: is a folder, not a trace file")):
        read_trace(tmp_path)
    with pytest.raises(TraceError, match=re.escape(f"{tmp_path / 'nope.jsonl'}: no such trace file")):
        read_trace(tmp_path / "nope.jsonl")


def test_an_undecodable_file_name_is_shown_printably(tmp_path):
    path = tmp_path / b"bad\xffname.jsonl".decode("utf-8", "surrogateescape")
    path.write_bytes(b"{oops\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert "bad\\xffname.jsonl:1: not valid JSON" in str(err.value)
    str(err.value).encode("utf-8")


def mutations(line: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Ways to break one line: byte flips, cuts, insertions of odd bytes and odd JSON."""
    out = []
    for _ in range(6):
        i = rng.randrange(len(line))
        out.append(("flip", line[:i] + bytes([line[i] ^ (1 << rng.randrange(8))]) + line[i + 1:]))
    for _ in range(3):
        out.append(("cut", line[:rng.randrange(len(line))]))
    for odd in (b"\xff", b"\xc3", b"\0", b"\\ud800", b"[" * 2000, b"NaN", b"1e999", b"-1", b"true", b"\"\""):
        i = rng.randrange(len(line))
        out.append(("insert", line[:i] + odd + line[i:]))
    out.append(("utf16", line.decode().encode("utf-16")))
    return out


def test_mutation_sweep_only_trace_errors_escape(tmp_path):
    rng = random.Random(14)
    calls = [json.dumps({"workflow_id": f"w{w}", "step": s, "agent": ["plan", "code"][s], "input_length": 8,
                         "output_length": 1, "hash_ids": [w * 10 + s, w * 10 + s + 100], "done": s == 1})
             for w in range(3) for s in range(2)]
    lines = [META.encode()] + [c.encode() for c in calls]
    answers: Counter = Counter()
    for k, line in enumerate(lines):
        for kind, bad in mutations(line, rng):
            content = b"\n".join(lines[:k] + [bad] + lines[k + 1:]) + b"\n"
            for name, data in (("m.jsonl", content), ("m.jsonl.gz", gz(content)), ("c.jsonl.gz", gz(content)[:-9])):
                path = tmp_path / name
                path.write_bytes(data)
                try:
                    read_trace(path)
                    answers["read"] += 1
                except TraceError as e:
                    msg = str(e)
                    assert re.match(re.escape(str(path)) + r"(:\d+)?: ", msg), msg
                    answers[re.split(r" \(|, ", msg[len(str(path)):].lstrip(":0123456789 "))[0]] += 1
    total = sum(answers.values())
    print(f"\nmutated trace files: {total}; answers: {dict(answers.most_common())}")
    assert total == len(lines) * 20 * 3 and answers["read"] < total
