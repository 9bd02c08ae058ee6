"""Hostile inputs to trace import/export/split (reproductions under hostile2/repro/1, 6, 7, 8, 9):
bad `delay_ms` on export, `--limit` cutting a session, what an export cannot carry, split metadata,
sessionless agentic rows, self-waits and wait_for cycles, Bailian timing of later turns, exit codes of bad
options, NaN in extra fields."""

import json
import re

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.trace import Call, Trace, TraceError, TraceMeta, read_trace, validate, write_trace
from pbkv.trace.formats import export_file, import_file, import_trace
from pbkv.trace.transform import split_by_task

runner = CliRunner()


def jsonl(path, rows):
    """Write `rows` (objects, or strings taken as they are) one a line; return the path."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def call(step, **kw):
    return {"workflow_id": "w", "step": step, "agent": "a", "input_length": 16, "output_length": 1,
            "hash_ids": [1], **kw}


def agentic_row(rid, session=None, **kw):
    row = {"request_id": rid, "timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1], **kw}
    if session is not None:
        row["session_id"] = session
    return row


def one_line(output: str) -> str:
    return output.replace("\n", "")


# ---------------------------------------------------------------- 1: delay_ms on export


@pytest.mark.parametrize("value, shown", [(None, "null"), ([1], r"\[1\]"), ({"a": 1}, r'\{"a": 1\}'),
                                          ("abc", "'abc'"), (-5, "-5"), (True, "true")],
                         ids=["null", "list", "object", "string", "negative", "bool"])
def test_export_refuses_a_bad_delay_ms_naming_file_line_field_and_value(tmp_path, value, shown):
    # a metadata line and a blank line before the calls: the line named is the file's, not the call's index
    src = jsonl(tmp_path / "t.jsonl", ['{"pbkv_trace": 1}', "", call(0), call(1, tool_wait=2, delay_ms=value)])
    with pytest.raises(TraceError, match=rf"(^|/)t.jsonl:4: field 'delay_ms': expected a finite number >= 0 .*, "
                                         rf"got {shown}$"):
        export_file("agentic-mooncake", src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()  # refused before anything is written


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_export_of_a_non_finite_delay_ms_fails_at_its_line_and_writes_nothing(tmp_path, value):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(call(0)) + "\n" + json.dumps(call(1, tool_wait=2))[:-1] + f', "delay_ms": {value}}}\n')
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(src), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1, r.output
    assert re.search(r"t.jsonl:2: field 'delay_ms': .*got -?(NaN|Infinity)", one_line(r.output)), r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_export_bad_delay_ms_is_one_error_line_not_a_traceback(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [call(0), call(1, tool_wait=2, delay_ms=None)])
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(src), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1 and not isinstance(r.exception, TypeError), r.output
    assert "t.jsonl:2: field 'delay_ms'" in one_line(r.output) and "got null" in one_line(r.output)


@pytest.mark.parametrize("rows, line, field", [
    ([call(0, t=1.7e308)], 1, "t"),
], ids=["t"])   # a tool_wait past 1e9 s is refused by the reader (MAX_TOOL_WAIT), and t + 1e9 cannot overflow
def test_export_refuses_times_whose_milliseconds_overflow(tmp_path, rows, line, field):
    # a valid trace (finite t, tool_wait): x 1000 gave inf, and json.dumps failed naming no line
    src = jsonl(tmp_path / "t.jsonl", rows)
    read_trace(src)
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(src), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1, r.output
    assert re.search(rf"^error: .*t.jsonl:{line}: field '{field}': expected at most 1.798e\+305 s.*written in "
                     rf"milliseconds, which must be a finite number, got 1(.7)?e\+30[58]$", one_line(r.output)), r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_a_valid_delay_ms_is_written_as_delay_and_reads_back(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [call(0), call(1, tool_wait=2, delay_ms=5)])
    export_file("agentic-mooncake", src, tmp_path / "o.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert (rows[1]["delay"], rows[1]["tool_wait_ms"]) == (5.0, 1995.0)
    back, _ = import_trace("agentic-mooncake", tmp_path / "o.jsonl", source_block_size=16)
    assert back.calls[1].extra == {"delay_ms": 5.0} and back.calls[1].tool_wait == pytest.approx(2.0)


@pytest.mark.parametrize("tool_wait, have", [(0.002, "tool_wait 0.002 s"), (None, "no tool_wait")],
                         ids=["shorter", "absent"])
def test_export_refuses_a_delay_ms_longer_than_the_tool_wait(tmp_path, tool_wait, have):
    # Dynamo waits delay + tool_wait_ms; pbkv's replay waits tool_wait: a delay of 5 ms cannot fit in 2 ms (or none)
    extra = {"tool_wait": tool_wait} if tool_wait is not None else {}
    src = jsonl(tmp_path / "t.jsonl", [call(0), call(1, delay_ms=5, **extra)])
    with pytest.raises(TraceError, match=rf"(^|/)t.jsonl:2: field 'delay_ms': expected at most the call's tool_wait "
                                         rf"in ms .*this call has {have}.*, got 5$"):
        export_file("agentic-mooncake", src, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("delay", [0.1, 0.3, 0.7, 1e-3, 123456.789, 0.0])
def test_a_delay_equal_to_the_whole_wait_survives_import_then_export(tmp_path, delay):
    # import: tool_wait = (delay + 0) / 1000; the export's x 1000 may round below delay: not a refusal
    rows = [agentic_row("a", "s"), agentic_row("b", "s", wait_for=["a"], delay=delay, tool_wait_ms=0)]
    trace, _ = import_trace("agentic-mooncake", jsonl(tmp_path / "a.jsonl", rows), source_block_size=16)
    export_file("agentic-mooncake", write_trace(trace, tmp_path / "t.jsonl"), tmp_path / "o.jsonl")
    out = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[1])
    assert out["delay"] == delay and "tool_wait_ms" not in out


# ---------------------------------------------------------------- 2: --limit cutting a session


def test_agentic_limit_leaves_done_unset_on_a_cut_session_and_says_so(tmp_path):
    src = jsonl(tmp_path / "a.jsonl", [agentic_row("a0", "s"), agentic_row("a1", "s", wait_for=["a0"]),
                                       agentic_row("a2", "s", wait_for=["a1"])])
    trace, report = import_trace("agentic-mooncake", src, source_block_size=16, limit=2)
    assert [(c.step, c.done) for c in trace.calls] == [(0, False), (1, None)]
    notes = [n for n in report.notes if "--limit" in n]
    assert len(notes) == 1 and "1 session(s) may continue past the cut" in notes[0]


@pytest.mark.parametrize("limit", [3, 10])
def test_a_limit_that_reaches_the_end_of_the_file_still_marks_done(tmp_path, limit):
    src = jsonl(tmp_path / "a.jsonl", [agentic_row("a0", "s"), agentic_row("a1", "s", wait_for=["a0"]),
                                       agentic_row("a2", "t"), "  "])  # a blank line after the last row
    trace, report = import_trace("agentic-mooncake", src, source_block_size=16, limit=limit)
    assert [c.done for c in trace.calls] == [False, True, True]
    assert not any("--limit" in n for n in report.notes)


def test_bailian_limit_leaves_done_unset_and_the_written_row_has_no_done(tmp_path):
    src = jsonl(tmp_path / "b.jsonl", [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1,
         "type": "text", "turn": 1, "hash_ids": [1]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1, "input_length": 32, "output_length": 1,
         "type": "text", "turn": 2, "hash_ids": [1, 2]}])
    _, report = import_file("bailian", src, tmp_path / "o.jsonl", limit=1)
    assert "done" not in json.loads((tmp_path / "o.jsonl").read_text().splitlines()[-1])
    assert sum("--limit" in n for n in report.notes) == 1


def test_a_bad_line_past_the_limit_is_not_an_error_but_the_file_goes_on(tmp_path):
    src = jsonl(tmp_path / "a.jsonl", [agentic_row("a0", "s"), "{not json"])
    trace, report = import_trace("agentic-mooncake", src, source_block_size=16, limit=1)
    assert trace.calls[0].done is None and any("--limit" in n for n in report.notes)


def test_mooncake_requests_stay_done_under_a_limit(tmp_path):
    src = jsonl(tmp_path / "m.jsonl", [{"timestamp": i, "input_length": 16, "output_length": 1, "hash_ids": [i]}
                                       for i in range(3)])
    trace, report = import_trace("mooncake", src, source_block_size=16, limit=2)
    assert [c.done for c in trace.calls] == [True, True] and not report.notes


# ---------------------------------------------------------------- 3: what an export cannot carry; split metadata


def test_export_names_what_the_format_cannot_carry_and_how_many_calls_had_it(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [call(0, context="task: x", logged_prompt_tokens=3, delay_ms=1),
                                       call(1, context="", tool_wait=1, delay_ms=7),  # delay_ms written here
                                       call(2, logged_prompt_tokens=4, tags=["a"])])
    report = export_file("agentic-mooncake", src, tmp_path / "o.jsonl")
    notes = [n for n in report.notes if n.startswith("not written")]
    assert notes == ["not written (agentic-mooncake rows have no field for it): `context` on 2 calls; "
                     "extra keys ('logged_prompt_tokens' on 2, 'delay_ms' on 1, 'tags' on 1)"]
    for line in (tmp_path / "o.jsonl").read_text().splitlines():  # and no field was invented for them
        assert not {"context", "logged_prompt_tokens", "tags", "delay_ms"} & set(json.loads(line))


def test_export_of_a_trace_it_carries_whole_has_no_such_note(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [call(0, t=0), call(1, tool_wait=1, delay_ms=7)])
    assert not export_file("agentic-mooncake", src, tmp_path / "o.jsonl").notes


def test_cli_export_prints_the_note_literally(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [call(0, t=0, context="hint", **{"[red]": 1})])
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(src), "-o", str(tmp_path / "o.jsonl")])
    out = one_line(r.output)
    assert r.exit_code == 0 and "note: not written" in out and "`context` on 1 call" in out
    assert "'[red]' on 1" in out  # a key from the file is not read as rich markup


def test_split_parts_do_not_carry_whole_file_counts(tmp_path):
    rows = [agentic_row(f"r{i}", f"s{i}") for i in range(12)]
    rows[1]["wait_for"], rows[1]["timestamp"] = ["r0"], 5  # a spawn edge: recorded in dropped_edges
    trace, _ = import_trace("agentic-mooncake", jsonl(tmp_path / "a.jsonl", rows), source_block_size=16)
    assert trace.meta.extra["dropped_edges"] == {"spawn": 1}
    train, test = split_by_task(trace, 0.5, seed=0)
    assert train.calls and test.calls
    for part, name in ((train, "train"), (test, "test")):
        back = read_trace(write_trace(part, tmp_path / f"{name}.jsonl"))
        assert "dropped_edges" not in back.meta.extra
        assert back.meta.notes.startswith(f"{name} part of a split by task (seed 0, test fraction 0.5)")
        assert back.meta.notes.endswith("; whole file: 12 agentic-mooncake rows; source block size 16, re-chained at 16")
        assert back.meta.source == trace.meta.source and back.block_size == trace.block_size
    assert trace.meta.extra["dropped_edges"] == {"spawn": 1}  # the whole trace's metadata is unchanged


# ---------------------------------------------------------------- 4: agentic sessions and self-waits


def test_a_row_without_session_does_not_join_a_session_named_like_its_request_id(tmp_path):
    src = jsonl(tmp_path / "m.jsonl", [agentic_row("a", "s"), agentic_row("s", timestamp=5)])
    trace, report = import_trace("agentic-mooncake", src, source_block_size=16)
    assert [(c.workflow_id, c.step, c.done) for c in trace.calls] == [("s", 0, True), ("s#1", 0, True)]
    assert any("renamed (first: 's#1')" in n for n in report.notes)


def test_renamed_sessionless_rows_collide_with_no_other_name(tmp_path):
    # 's#1' is taken by a sessionless row's own id, 's#2' by a session: the renamed row gets 's#3'
    src = jsonl(tmp_path / "m.jsonl", [agentic_row("a", "s"), agentic_row("b", "s#2"), agentic_row("s"),
                                       agentic_row("s#1")])
    trace, _ = import_trace("agentic-mooncake", src, source_block_size=16)
    assert [c.workflow_id for c in trace.calls] == ["s", "s#2", "s#3", "s#1"]
    assert all(c.step == 0 for c in trace.calls)


def test_a_row_waiting_for_itself_is_an_error(tmp_path):
    src = jsonl(tmp_path / "w.jsonl", [agentic_row("a", "s"), agentic_row("b", "s", wait_for=["a", "b"])])
    with pytest.raises(TraceError, match=r"(^|/)w.jsonl:2: field 'wait_for': names the row's own request_id 'b': a row "
                                         r"cannot wait for itself .*, got \[\"a\", \"b\"\]$"):
        import_trace("agentic-mooncake", src, source_block_size=16)


@pytest.mark.parametrize("waits, message", [
    ({"a": ["b"], "b": ["a"]}, r"(^|/)w.jsonl:2: field 'wait_for': wait_for links form a cycle of 2 rows: 'a' \(line 2\), "
                               r"which waits for 'b' \(line 3\), which waits for 'a' .*, got \[\"b\"\]$"),
    ({"a": ["x"], "b": ["a"], "c": ["b"], "x": ["c"]},
     r"(^|/)w.jsonl:1: field 'wait_for': wait_for links form a cycle of 4 rows: 'x' \(line 1\), which waits for 'c' "
     r"\(line 4\), which waits for 'b' \(line 3\), which waits for 'a' \(line 2\), which waits for 'x' "
     r"\(a deadlock in Dynamo's replay\), got \[\"c\"\]$"),
    ({"c": ["b", "a"], "b": ["c"]}, r"(^|/)w.jsonl:3: field 'wait_for': .*cycle of 2 rows: 'b' \(line 3\), "
                                    r"which waits for 'c' \(line 4\), which waits for 'b'"),
], ids=["two", "four-from-the-first-row", "not-through-the-first-row"])
def test_a_wait_for_cycle_of_any_length_is_an_error_naming_its_rows_and_lines(tmp_path, waits, message):
    # rows x (line 1), a, b, c, in two sessions: a cycle may cross sessions and need not start at line 1
    rows = [agentic_row(rid, "s" if rid in "ab" else "t", wait_for=waits.get(rid, [])) for rid in "xabc"]
    with pytest.raises(TraceError, match=message):
        import_trace("agentic-mooncake", jsonl(tmp_path / "w.jsonl", rows), source_block_size=16)


def test_a_long_wait_for_cycle_is_found_without_recursion(tmp_path):
    n = 3000  # deeper than Python's recursion limit
    rows = [agentic_row(f"r{i}", "s", wait_for=[f"r{(i - 1) % n}"]) for i in range(n)]
    with pytest.raises(TraceError, match=rf"w.jsonl:1: field 'wait_for': wait_for links form a cycle of {n} rows: "
                                         rf"'r0' \(line 1\), which waits for 'r2999' \(line 3000\), "):
        import_trace("agentic-mooncake", jsonl(tmp_path / "w.jsonl", rows), source_block_size=16)


def test_wait_for_links_that_meet_without_a_cycle_are_accepted(tmp_path):
    # a diamond (d waits for b and c, both for a) and a link cut by --limit close no cycle
    rows = [agentic_row("a", "s"), agentic_row("b", "s", wait_for=["a"]), agentic_row("c", "t", wait_for=["a"]),
            agentic_row("d", "s", wait_for=["b", "c", "e"]), agentic_row("e", "s", wait_for=["d"])]
    trace, report = import_trace("agentic-mooncake", jsonl(tmp_path / "w.jsonl", rows), source_block_size=16, limit=4)
    assert [(c.workflow_id, c.step) for c in trace.calls] == [("s", 0), ("s", 1), ("t", 0), ("s", 2)]
    assert ("d", "e", "dangling") not in {(e.src, e.dst, e.kind) for e in report.dropped_edges}


def test_a_row_branching_to_itself_is_an_error(tmp_path):
    src = jsonl(tmp_path / "w.jsonl", [agentic_row("a", "s", branches=["b", "a"]), agentic_row("b", "t")])
    with pytest.raises(TraceError, match=r"(^|/)w.jsonl:1: field 'branches': names the row's own request_id 'a': a row "
                                         r"cannot spawn itself, got \[\"b\", \"a\"\]$"):
        import_trace("agentic-mooncake", src, source_block_size=16)


def bailian_row(chat, parent, t, turn, **kw):
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t, "input_length": 16, "output_length": 1,
            "type": "text", "turn": turn, "hash_ids": [1], **kw}


def test_a_bailian_chat_that_is_its_own_parent_is_an_error(tmp_path):
    src = jsonl(tmp_path / "b.jsonl", [bailian_row(1, -1, 0.0, 1), bailian_row(3, 3, 1.0, 2)])
    with pytest.raises(TraceError, match=r"(^|/)b.jsonl:2: field 'parent_chat_id': a chat cannot be its own parent, "
                                         r"got 3$"):
        import_trace("bailian", src)


# ---------------------------------------------------------------- 4b: Bailian timing of later turns


def test_bailian_later_turns_wait_the_gap_since_the_previous_arrival(tmp_path):
    # replay starts a workflow at its first t and issues later steps tool_wait after the previous one ends:
    # without a tool_wait, turns 30 s apart in the trace would run back to back
    rows = [bailian_row(1, -1, 1.0, 1), bailian_row(5, -1, 2.0, 1), bailian_row(2, 1, 31.0, 2),
            bailian_row(3, 2, 31.1, 3), bailian_row(6, 5, 2.0, 2)]
    trace, report = import_trace("bailian", jsonl(tmp_path / "b.jsonl", rows))
    wfs = trace.workflows()
    assert [(c.t, c.tool_wait) for c in wfs["bailian-1"]] == [(1.0, None), (31.0, 30.0), (31.1, 0.1)]
    assert [(c.t, c.tool_wait) for c in wfs["bailian-5"]] == [(2.0, None), (2.0, 0.0)]
    assert not any("arrived before" in n for n in report.notes)
    back = read_trace(write_trace(trace, tmp_path / "t.jsonl"))
    assert [c.tool_wait for c in back.calls] == [None, None, 30.0, 0.1, 0.0]


def test_a_bailian_step_that_arrived_before_its_predecessor_waits_0_and_is_noted(tmp_path):
    # turn first: chat 4 (turn 3, t=6) runs after chat 2 (turn 2, t=10), though it arrived earlier
    rows = [bailian_row(1, -1, 0.0, 1), bailian_row(2, 1, 10.0, 2), bailian_row(3, 1, 4.0, 2),
            bailian_row(4, 3, 6.0, 3)]
    trace, report = import_trace("bailian", jsonl(tmp_path / "b.jsonl", rows))
    assert [(c.t, c.tool_wait) for c in trace.workflows()["bailian-1"]] == [
        (0.0, None), (4.0, 4.0), (10.0, 6.0), (6.0, 0.0)]
    assert "1 chat(s) arrived before the previous step of their workflow (steps are ordered by turn, then " \
           "timestamp): their tool_wait is 0" in report.notes


# ---------------------------------------------------------------- 5: exit codes of bad options


@pytest.mark.parametrize("args, message", [
    (["import", "--from", "nope", "{src}", "-o", "{out}"], "cannot read format 'nope'"),
    (["export", "{src}", "--to", "nope", "-o", "{out}"], "cannot write format 'nope'"),
    (["import", "--from", "agentic-mooncake", "{agentic}", "-o", "{out}"], "do not record their block size"),
], ids=["from", "to", "source-block-size"])
def test_bad_option_values_exit_2(tmp_path, args, message):
    names = {"src": str(jsonl(tmp_path / "t.jsonl", [call(0)])), "out": str(tmp_path / "o.jsonl"),
             "agentic": str(jsonl(tmp_path / "a.jsonl", [agentic_row("a", "s")]))}
    r = runner.invoke(app, ["trace"] + [a.format(**names) for a in args])
    assert r.exit_code == 2 and message in one_line(r.output), r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_data_still_exits_1(tmp_path):
    src = jsonl(tmp_path / "a.jsonl", [{"request_id": "a"}])
    r = runner.invoke(app, ["trace", "import", "--from", "agentic-mooncake", str(src), "--source-block-size", "16",
                            "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1 and "a.jsonl:1: field" in one_line(r.output)


# ---------------------------------------------------------------- 6: NaN and Infinity in extra fields


@pytest.mark.parametrize("value, shown", [("NaN", "NaN"), ("-Infinity", "-Infinity"), ("1e999", "Infinity"),
                                          ('{"a": [1, NaN]}', r'\{"a": \[1, NaN\]\}')])
def test_a_non_finite_number_in_an_extra_field_is_refused_at_its_line(tmp_path, value, shown):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(call(0)) + "\n" + json.dumps(call(1))[:-1] + f', "score": {value}}}\n')
    with pytest.raises(TraceError, match=rf"(^|/)t.jsonl:2: field 'score': expected JSON numbers to be finite .*, "
                                         rf"got {shown}$"):
        read_trace(src)


def test_a_non_finite_number_in_the_metadata_is_refused(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"pbkv_trace": 1, "ratio": NaN}\n' + json.dumps(call(0)) + "\n")
    with pytest.raises(TraceError, match=r"(^|/)t.jsonl:1: field 'ratio': expected JSON numbers to be finite"):
        read_trace(src)


def test_split_of_a_trace_with_nan_fails_and_writes_no_invalid_json(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(call(0, workflow_id=f"w{i}"))[:-1] + ', "x": NaN}\n' for i in range(4)))
    r = runner.invoke(app, ["trace", "split", str(src), "--train-out", str(tmp_path / "a.jsonl"),
                            "--test-out", str(tmp_path / "b.jsonl")])
    assert r.exit_code == 1 and "t.jsonl:1: field 'x'" in one_line(r.output), r.output
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "b.jsonl").exists()


def test_an_in_memory_nan_is_refused_by_validate_and_never_written(tmp_path):
    trace = Trace(TraceMeta(), [Call("w", 0, "a", 16, 1, [1], extra={"x": float("nan")})])
    with pytest.raises(TraceError, match=r"field 'x': expected JSON numbers to be finite"):
        validate(trace, "mem")
    with pytest.raises(ValueError):
        write_trace(trace, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- hostile13: first waits, order, metadata


def test_a_first_calls_tool_wait_is_written_as_a_later_timestamp_and_noted(tmp_path):
    """Before: dropped without a note (a replay of the export ran 30 s sooner)."""
    src = jsonl(tmp_path / "t.jsonl", [call(0, t=2, tool_wait=30), call(1, tool_wait=2)])
    report = export_file("agentic-mooncake", src, tmp_path / "o.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert rows[0]["timestamp"] == 32000.0 and "delay" not in rows[0]
    assert any(n.startswith("1 workflows' first call has a tool_wait: written as a later `timestamp`")
               for n in report.notes)
    back, _ = import_trace("agentic-mooncake", tmp_path / "o.jsonl", source_block_size=16)
    assert [(c.t, c.tool_wait) for c in back.calls] == [(32.0, None), (None, 2.0)]   # issued at the same times
    untimed = jsonl(tmp_path / "u.jsonl", [call(0, tool_wait=2.5), call(1)])   # no t: the note said "at timestamp 0"
    report = export_file("agentic-mooncake", untimed, tmp_path / "u.out.jsonl")
    assert json.loads((tmp_path / "u.out.jsonl").read_text().splitlines()[0])["timestamp"] == 2500.0
    assert "1 workflows have no arrival time `t`: their first rows start at timestamp 0 (plus the first call's " \
           "tool_wait, if any)" in report.notes


def test_a_first_rows_delay_is_not_kept_and_the_import_says_so(tmp_path):
    rows = [agentic_row("r1", "s", delay=500, tool_wait_ms=250), agentic_row("r2", "s", wait_for=["r1"], delay=10)]
    trace, report = import_trace("agentic-mooncake", jsonl(tmp_path / "a.jsonl", rows), source_block_size=16)
    assert [c.tool_wait for c in trace.calls] == [None, 0.01]
    assert any(n.startswith("1 session first rows without wait_for carry `delay`/`tool_wait_ms` (first: 'r1')")
               for n in report.notes)


def test_a_row_listed_before_the_row_it_waits_for_runs_after_it(tmp_path):
    """Before: steps followed file order, so b ran first: the dependency reversed."""
    rows = [agentic_row("b", "s", wait_for=["a"], delay=100), agentic_row("a", "s", timestamp=5000),
            agentic_row("c", "s", wait_for=["b"])]
    del rows[0]["timestamp"], rows[2]["timestamp"]
    trace, report = import_trace("agentic-mooncake", jsonl(tmp_path / "a.jsonl", rows), source_block_size=16)
    steps = {c.extra.get("delay_ms", c.t): c.step for c in trace.calls}
    assert steps == {100.0: 1, 5.0: 0, None: 2} and not report.dropped_edges
    assert [c.tool_wait for c in sorted(trace.calls, key=lambda c: c.step)] == [None, 0.1, None]
    assert any(n.startswith("1 rows are listed before a row of their session that they wait for")
               for n in report.notes)


def test_export_names_the_metadata_it_cannot_write_and_carries_the_workload(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [{"pbkv_trace": 1, "block_size": 16, "license": "CC-BY-4.0",
                                        "source": "lab", "workload": "chatdev", "team": 3},
                                       call(0, t=0), call(1)])
    report = export_file("agentic-mooncake", src, tmp_path / "o.jsonl")
    assert "not written (agentic-mooncake files have no metadata line): license 'CC-BY-4.0', source 'lab', " \
           "'team'" in report.notes
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert {r["workload"] for r in rows} == {"chatdev"}
