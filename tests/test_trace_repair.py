"""`pbkv trace repair`: a `--record` file cut by kill -9 keeps its whole runs (real recorder files,
cut byte-wise where a killed write can stop)."""

from __future__ import annotations

import gzip

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.serve.recorder import TraceRecorder
from pbkv.trace import Call, TraceError, read_trace
from pbkv.trace.repair import repair

runner = CliRunner()


def recorded(tmp_path, runs: int = 3, steps: int = 4):
    """A real recorder file of `runs` whole runs; its bytes."""
    rec = TraceRecorder(tmp_path / "rec", "s", 16, "tiny")
    for n in range(runs):
        rec.record([Call(f"w{n}", s, "agent", 16 * (s + 1), 4, list(range(n * 100, n * 100 + s + 1)))
                    for s in range(steps)])
    rec.close()
    return rec.files[0].read_bytes()


def test_a_file_cut_inside_a_run_keeps_the_runs_before_it(tmp_path):
    whole = recorded(tmp_path)
    lines = whole.split(b"\n")                     # metadata, 3 runs of 4 lines, ""
    cut = b"\n".join(lines[:1 + 4 + 4 + 2]) + b"\n" + lines[11][:25]   # run w2: 2 whole lines, a third cut
    f = tmp_path / "cut.jsonl"
    f.write_bytes(cut)
    with pytest.raises(TraceError, match=r"cut\.jsonl:12: not valid JSON .*the file ends inside this line.*"
                                         r"pbkv trace repair"):
        read_trace(f)
    fixed = repair(f)
    assert (fixed.cut_line, fixed.dropped_calls) == (12, 2)
    assert fixed.data == b"\n".join(lines[:9]) + b"\n"
    out = tmp_path / "fixed.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(out)])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())                        # the console wraps long lines
    assert "ends inside line 12" in said and "2 whole call lines" in said and "kept 8 calls of 2" in said
    trace = read_trace(out)
    assert sorted(trace.workflows()) == ["w0", "w1"] and all(c[-1].done for c in trace.workflows().values())


def test_a_cut_first_run_leaves_the_metadata_and_a_whole_file_is_copied(tmp_path):
    whole = recorded(tmp_path, runs=1)
    f = tmp_path / "cut.jsonl"
    f.write_bytes(whole[:whole.index(b"\n") + 30])            # the header, then part of the first call
    fixed = repair(f)
    assert (fixed.cut_line, fixed.dropped_calls) == (2, 0) and fixed.data == whole[:whole.index(b"\n") + 1]
    assert read_trace_bytes(tmp_path, fixed.data).calls == []
    g = tmp_path / "whole.jsonl"
    g.write_bytes(whole)
    assert repair(g).cut_line is None and repair(g).data == whole
    out = tmp_path / "copy.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(g), "-o", str(out)])
    assert r.exit_code == 0 and "not cut" in " ".join(r.output.split()) and out.read_bytes() == whole
    gz = tmp_path / "copy.jsonl.gz"  # compressed like every trace written to a .gz name
    assert runner.invoke(app, ["trace", "repair", str(g), "-o", str(gz)]).exit_code == 0
    assert gzip.decompress(gz.read_bytes()) == whole


def test_a_recording_cut_at_a_line_end_drops_its_unfinished_run_another_trace_is_kept(tmp_path):
    whole = recorded(tmp_path)
    lines = whole.split(b"\n")
    f = tmp_path / "cut.jsonl"
    f.write_bytes(b"\n".join(lines[:11]) + b"\n")          # run w2: 2 whole lines, no done
    assert sorted(read_trace(f).workflows()) == ["w0", "w1", "w2"]   # it reads: nothing says it is cut
    fixed = repair(f)
    assert (fixed.cut_line, fixed.dropped_calls, fixed.at_line_end) == (11, 2, True)
    assert fixed.data == b"\n".join(lines[:9]) + b"\n"
    out = tmp_path / "fixed.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(out)])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and "stops at line 11 without 'done'" in said and "kept 8 calls of 2" in said
    g = tmp_path / "other.jsonl"                               # not a recording: runs need no done
    g.write_bytes(b"\n".join([b'{"pbkv_trace":1,"block_size":16}'] + lines[9:11]) + b"\n")
    assert repair(g).cut_line is None


def test_what_repair_cannot_fix_is_an_error_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"workflow_id":"w","step":0,"agent":"a","input_length":16,"output_length":1,'
                    b'"hash_ids":[1],"done":true}\n{"workflow_id":"w","step":0,"agent":"a","input_length":16,'
                    b'"output_length":1,"hash_ids":[1],"done":true}\n{"cut')
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(bad), "-o", str(out)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "bad.jsonl:2: " in said and "duplicate step 0" in said and not out.exists()
    assert list(tmp_path.glob(".out.jsonl*")) == []   # the error names the input, not the temporary
    bad.write_bytes(b'{"pbkv_trace":1,"block_size":4}\n{"workflow_id":"w",\xff\n{"workflow_id":"w","step":0,'
                    b'"agent":"a","input_length":16,"output_length":1,"hash_ids":[1],"done":true}\n{"cut')
    r = runner.invoke(app, ["trace", "repair", str(bad), "-o", str(out)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "bad.jsonl:2: not UTF-8 text (byte 0xff at column 20)" in said, r.output
    with pytest.raises(TraceError, match="plain .jsonl files only"):
        repair(tmp_path / "x.jsonl.gz")


def read_trace_bytes(tmp_path, data: bytes):
    f = tmp_path / "check.jsonl"
    f.write_bytes(data)
    return read_trace(f)
