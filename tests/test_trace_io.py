"""Trace format v1 (docs/trace-format.md) reading and writing: every rule is enforced with file, line, field and value."""

import gzip
import json
import os

import pytest

from pbkv.trace import Call, Trace, TraceError, TraceMeta, read_trace, validate, write_trace

META = {"pbkv_trace": 1, "block_size": 4}


def call(**kw):
    base = {"workflow_id": "w", "step": 0, "agent": "a", "input_length": 9, "output_length": 3,
            "hash_ids": [1, 2, 3]}
    base.update(kw)
    return base


def write(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def test_reads_a_valid_trace_and_keeps_unknown_fields(tmp_path):
    path = write(tmp_path, [META, call(extra_field=1, context="hint", t=0.5, tool_wait=2, done=False),
                            call(step=1, hash_ids=[1, 2, 4], done=True)])
    trace = read_trace(path)
    assert trace.block_size == 4 and len(trace.calls) == 2
    assert trace.calls[0].extra == {"extra_field": 1} and trace.calls[0].tool_wait == 2.0
    back = read_trace(write_trace(trace, tmp_path / "copy.jsonl.gz"))
    assert [c.extra for c in back.calls] == [{"extra_field": 1}, {}]
    assert gzip.open(tmp_path / "copy.jsonl.gz").read().startswith(b'{"pbkv_trace":1')


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    import pbkv.trace.io as trace_io
    path = write_trace(Trace(TraceMeta(block_size=4), [Call("w", 0, "a", 4, 1, [7])]), tmp_path / "t.jsonl")
    before = path.read_bytes()

    def lines_then_fail(trace):
        yield '{"pbkv_trace":1}'
        raise OSError("disk full")
    monkeypatch.setattr(trace_io, "iter_lines", lines_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_trace(Trace(TraceMeta(block_size=4), []), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


def test_a_killed_writers_temporary_is_removed_by_the_next_write_a_live_ones_is_kept(tmp_path):
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".t.jsonl.{dead.pid}-0123abcd.jsonl"       # what a kill -9 mid-write leaves
    live = tmp_path / f".t.jsonl.{os.getpid()}-89abcdef.jsonl"     # a write in progress in this process
    other = tmp_path / f".u.jsonl.{dead.pid}-0123abcd.jsonl"       # another file's: not this write's business
    for p in (left, live, other):
        p.write_text("half")
    write_trace(Trace(TraceMeta(block_size=4), [Call("w", 0, "a", 4, 1, [7])]), tmp_path / "t.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "t.jsonl"])


def test_a_written_trace_has_the_umasks_mode_and_a_folder_is_refused(tmp_path):
    import os
    old = os.umask(0o022)
    try:
        path = write_trace(Trace(TraceMeta(block_size=4), [Call("w", 0, "a", 4, 1, [7])]), tmp_path / "t.jsonl")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644  # not a temporary file's 0600
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        write_trace(read_trace(path), tmp_path)


def test_gzip_output_is_byte_identical(tmp_path):
    trace = Trace(TraceMeta(block_size=4), [Call("w", 0, "a", 4, 1, [7])])
    a = write_trace(trace, tmp_path / "a.jsonl.gz").read_bytes()
    b = write_trace(trace, tmp_path / "b.jsonl.gz").read_bytes()
    assert a == b


@pytest.mark.parametrize("lines, message", [
    ([META, "{not json"], r"t.jsonl:2: not valid JSON"),
    ([META, [1, 2]], r"t.jsonl:2: expected a JSON object, got \[1, 2\]"),
    ([META, {k: v for k, v in call().items() if k != "agent"}], r"t.jsonl:2: field 'agent': required field is missing$"),
    ([META, call(step="0")], r"t.jsonl:2: field 'step': expected an integer >= 0, got '0'"),
    ([META, call(step=True)], r"field 'step': expected an integer >= 0, got true"),
    ([META, call(input_length=0, hash_ids=[])], r"field 'input_length': expected an integer >= 1, got 0"),
    ([META, call(output_length=-1)], r"field 'output_length': expected an integer >= 0, got -1"),
    ([META, call(hash_ids=[1, 2])], r"t.jsonl:2: field 'hash_ids': expected 3 ids for input_length 9 and block_size 4, found 2"),
    ([META, call(hash_ids=[1, "x", 3])], r"field 'hash_ids': expected a list of integers"),
    ([META, call(t=-1)], r"field 't': expected a finite number >= 0, got -1"),
    ([META, call(tool_wait="soon")], r"field 'tool_wait': expected a finite number >= 0, got 'soon'"),
    ([META, call(tool_wait=1e308)], r"field 'tool_wait': expected at most 1,000,000,000 \(seconds\), got 1e\+308"),
    # a JSON integer too large for a float: an error, not an OverflowError
    ([META, call(t=10**400)], r"t.jsonl:2: field 't': expected a finite number >= 0, got 1000000000"),
    ([META, call(tool_wait=10**400)], r"t.jsonl:2: field 'tool_wait': expected a finite number >= 0, got 1000"),
    ([META, call(output_length=10**400)], r"t.jsonl:2: field 'output_length': expected an integer from 0 to "
                                          r"1,000,000,000, got 1000000000"),
    ([META, call(input_length=10**9 + 1, hash_ids=[1])], r"t.jsonl:2: field 'input_length': expected an integer "
                                                         r"from 1 to 1,000,000,000, got 1000000001$"),
    ([META, call(done="yes")], r"field 'done': expected true or false, got 'yes'"),
    ([META, call(), call()], r"t.jsonl:3: field 'step': duplicate step 0 of workflow 'w' \(first at line 2\)"),
    ([META, call(), call(step=2, hash_ids=[1, 2, 5])], r"t.jsonl:3: field 'step': workflow 'w' has no step 1"),
    ([META, call(done=True), call(step=1, hash_ids=[1, 2, 6])], r"t.jsonl:2: field 'done': true on step 0 but workflow 'w' continues"),
    ([META, call(), call(workflow_id="v", hash_ids=[2, 1, 3])], r"t.jsonl:3: field 'hash_ids': id 2 at position 0 follows None"),
    ([call(hash_ids=[1]), META], r"t.jsonl:2: field 'pbkv_trace': the metadata line must come before every call"),
    ([{"pbkv_trace": 2}], r"t.jsonl:1: field 'pbkv_trace': only trace format version 1 is supported, got 2"),
    ([{"pbkv_trace": 1, "block_size": 0}], r"field 'block_size': expected an integer >= 1, got 0"),
])
def test_bad_lines_name_file_line_field_and_value(tmp_path, lines, message):
    with pytest.raises(TraceError, match=message):
        read_trace(write(tmp_path, lines))


def test_default_block_size_and_blank_lines(tmp_path):
    path = write(tmp_path, ["", {**call(), "input_length": 20, "hash_ids": [5, 6]}, "  "])
    assert read_trace(path).block_size == 16


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "nope.jsonl")


def test_validate_checks_in_memory_traces():
    bad = Trace(TraceMeta(block_size=4), [Call("w", 1, "a", 4, 1, [1])])
    with pytest.raises(TraceError, match="has no step 0"):
        validate(bad)


def test_a_symlink_is_written_through_a_device_directly_and_a_file_keeps_its_mode(tmp_path):
    trace = Trace(TraceMeta(block_size=4), [Call("w", 0, "a", 4, 1, [7])])
    target = tmp_path / "target.jsonl"
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    write_trace(trace, link)
    assert link.is_symlink() and read_trace(target).calls[0].hash_ids == [7]
    assert target.stat().st_mode & 0o777 == 0o600
    write_trace(trace, "/dev/null")                    # written to, not replaced by a file
    assert not os.path.isfile("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "target.jsonl"]
