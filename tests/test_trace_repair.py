"""`pbkv trace repair`: a `--record` file cut by kill -9 keeps its whole runs (real recorder files,
cut byte-wise where a killed write can stop)."""

from __future__ import annotations

import gzip
import json

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


def line(wf: str, step: int, done: bool | None = None, **extra) -> bytes:
    """One call line of run `wf` (ids chained per step, so every line is valid)."""
    d = {"workflow_id": wf, "step": step, "agent": "A", "input_length": 4, "output_length": 1,
         "hash_ids": [1], **extra}
    if done is not None:
        d["done"] = done
    return json.dumps(d, separators=(",", ":")).encode()


def test_interleaved_runs_keep_only_the_whole_ones(tmp_path):
    """Run x's done step is the cut line: x is dropped entirely (steps 0-1 too), whole run y kept."""
    head = b'{"pbkv_trace":1,"block_size":4}'
    f = tmp_path / "t.jsonl"
    f.write_bytes(b"\n".join([head, line("x", 0, False), line("y", 0, False), line("x", 1, False),
                              line("y", 1, True), line("z", 0, True)]) + b"\n" + line("x", 2, True)[:40])
    fixed = repair(f)
    assert (fixed.cut_line, fixed.dropped_calls, fixed.dropped_runs) == (7, 2, 1)
    assert fixed.data == b"\n".join([head, line("y", 0, False), line("y", 1, True), line("z", 0, True)]) + b"\n"
    out = tmp_path / "o.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert " ".join(r.output.split()) == (
        f"{f}: ends inside line 7; dropped every run without a 'done': true call (2 whole call lines of "
        f"1 run) and the cut line; kept 3 calls of 2 workflows in {out}")
    assert sorted(read_trace(out).workflows()) == ["y", "z"]


def test_without_any_done_no_run_is_known_whole_and_the_message_says_so(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b"\n".join([b'{"pbkv_trace":1,"block_size":4}', line("x", 0), line("y", 0), line("x", 1)])
                  + b"\n" + line("y", 1)[:30])
    fixed = repair(f)
    assert (fixed.dropped_calls, fixed.dropped_runs, fixed.any_done) == (3, 2, False)
    assert fixed.data == b'{"pbkv_trace":1,"block_size":4}\n'
    out = tmp_path / "o.jsonl"
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert " ".join(r.output.split()) == (
        f"{f}: ends inside line 5; no call line has 'done': true, so no run is known to be whole: dropped "
        f"every call (3 whole call lines of 2 runs) and the cut line; kept 0 calls of 0 workflows in {out}")


def test_a_stop_at_a_line_end_names_the_last_call_line_not_a_trailing_blank_one(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_bytes(b"\n".join([b'{"pbkv_trace":1,"block_size":4,"source":"pbkv serve test"}',
                              line("a", 0, True), line("c", 0, False), b"", b""]) + b"\n")
    fixed = repair(f)
    assert (fixed.cut_line, fixed.dropped_calls, fixed.at_line_end) == (3, 1, True)
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 0 and "its last run stops at line 3 without 'done'" in " ".join(r.output.split())


def test_an_error_after_a_dropped_run_names_the_files_own_line(tmp_path):
    """Dropped lines in the middle do not shift the line numbers of what repair cannot fix."""
    f = tmp_path / "t.jsonl"
    f.write_bytes(b"\n".join([line("x", 0, False), line("y", 0, True), line("z", 0, True, t=-1)])
                  + b"\n" + line("x", 1, True)[:30])
    r = runner.invoke(app, ["trace", "repair", str(f), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1 and "t.jsonl:3: field 't'" in " ".join(r.output.split()), r.output
