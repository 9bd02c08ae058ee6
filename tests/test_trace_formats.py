"""Trace interop: Mooncake / Qwen-Bailian / Dynamo agentic-mooncake in, agentic-mooncake out.

Fixtures in tests/data/interop/ were written for these tests (a few rows each; bad/ holds one
malformed case per file)."""

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from pbkv.cache import RadixTree, Tier
from pbkv.cli import app
from pbkv.trace import Call, Trace, TraceError, TraceMeta, read_trace, validate, write_trace
from pbkv.trace.formats import FORMATS, Rechainer, export_file, import_file, import_trace
from pbkv.workloads import generate, load_spec

DATA = Path(__file__).parent / "data" / "interop"


def canonical(calls):
    """Each call's ids renumbered by first appearance: equal across traces iff sharing is equal."""
    names: dict[int, int] = {}
    return [[names.setdefault(h, len(names)) for h in c.hash_ids] for c in calls]


def test_mooncake_rows_become_one_call_workflows():
    trace, report = import_trace("mooncake", DATA / "mooncake.jsonl")
    assert trace.block_size == 512 and report.rows == 4 and not report.dropped_edges
    assert [(c.workflow_id, c.step, c.agent, c.t, c.done) for c in trace.calls] == [
        ("mooncake-1", 0, "chat", 0.0, True), ("mooncake-2", 0, "chat", 0.0, True),
        ("mooncake-4", 0, "chat", 2.5, True), ("mooncake-5", 0, "chat", 4.0, True)]
    # raw [0,1,2] [0,1,3] [0] [4,1,2,5,6]: ids re-chained by prefix, so the 1 and 2 of line 5 are new;
    # line 4's only block is partial (300 tokens), so it is not line 1's full block 0
    assert canonical(trace.calls) == [[0, 1, 2], [0, 1, 3], [4], [5, 6, 7, 8, 9]]
    assert [(c.input_length, c.output_length) for c in trace.calls] == [(1200, 40), (1500, 12), (300, 7), (2100, 90)]


def test_bailian_sessions_from_parent_links_turn_then_timestamp():
    trace, report = import_trace("bailian", DATA / "bailian.jsonl")
    wfs = trace.workflows()
    assert list(wfs) == ["bailian-10", "bailian-11", "bailian-15"]
    # chat 12 has two children of turn 3: 14 (t=5.5) runs before 13 (t=6.0)
    assert [(c.step, c.agent, c.t) for c in wfs["bailian-10"]] == [
        (0, "text", 0.5), (1, "text", 3.0), (2, "text", 5.5), (3, "file", 6.0)]
    assert [c.done for c in wfs["bailian-10"]] == [False, False, False, True]
    assert [(e.src, e.dst, e.kind) for e in report.dropped_edges] == [("12", "13", "branch")]
    assert any("1 chat(s) name a parent that is not in the file" in n for n in report.notes)
    assert wfs["bailian-15"][0].agent == "image" and trace.meta.extra["dropped_edges"] == {"branch": 1}


def test_agentic_sessions_tool_waits_and_reported_dag_edges():
    trace, report = import_trace("agentic-mooncake", DATA / "agentic.jsonl", source_block_size=32)
    wfs = trace.workflows()
    assert [(c.step, c.agent) for c in wfs["root"]] == [(0, "main"), (1, "main"), (2, "main")]
    assert [c.agent for c in wfs["child"]] == ["subagent", "subagent"]
    # tool_wait = (delay + tool_wait_ms) / 1000 on every step after the first
    assert [c.tool_wait for c in wfs["root"]] == [None, pytest.approx(0.25), pytest.approx(0.1005)]
    assert [c.tool_wait for c in wfs["child"]] == [None, pytest.approx(0.04)]
    assert [c.t for c in wfs["root"]] == [0.0, 0.4, 0.9]
    assert [(e.src, e.dst, e.kind, e.wait_ms) for e in report.dropped_edges] == [
        ("r1", "c1", "spawn", 50.0), ("c2", "r3", "join", 100.5)]
    assert report.summary(2, 5).endswith("2 DAG edges not expressible as workflow steps (1 join, 1 spawn)")
    assert "r1 -> c1 (spawn, waits 50 ms)" in report.edge_note()


def test_agentic_needs_its_block_size():
    with pytest.raises(TraceError, match="agentic-mooncake files do not record their block size"):
        import_trace("agentic-mooncake", DATA / "agentic.jsonl")


BAD = [
    ("mooncake", "mooncake_hash_len.jsonl", r"mooncake_hash_len.jsonl:2: field 'hash_ids': expected 3 ids for "
                                            r"input_length 1200 and source block size 512, found 2"),
    ("mooncake", "mooncake_no_timestamp.jsonl", r"mooncake_no_timestamp.jsonl:2: field 'timestamp': required field is missing$"),
    ("mooncake", "mooncake_json.jsonl", r"mooncake_json.jsonl:3: not valid JSON"),
    ("mooncake", "mooncake_output.jsonl", r"mooncake_output.jsonl:1: field 'output_length': expected an integer >= 0, got -3"),
    ("bailian", "bailian_dup.jsonl", r"bailian_dup.jsonl:2: field 'chat_id': duplicate chat_id \(first at line 1\), got 10"),
    ("bailian", "bailian_type.jsonl", r"bailian_type.jsonl:1: field 'type': expected a non-empty string, got 5"),
    ("bailian", "bailian_cycle.jsonl", r"bailian_cycle.jsonl:1: field 'parent_chat_id': parent links form a cycle through chats \[1, 2\], got 2"),
    ("bailian", "bailian_parent.jsonl", r"bailian_parent.jsonl:1: field 'parent_chat_id': expected an integer >= -1, got -2"),
    ("bailian", "bailian_timestamp.jsonl", r"bailian_timestamp.jsonl:1: field 'timestamp': expected a finite number >= 0, got '0.5'"),
    ("agentic-mooncake", "agentic_unknown_dep.jsonl", r"agentic_unknown_dep.jsonl:2: field 'wait_for': names request 'nope', which is not in the file, got \[\"nope\"\]"),
    ("agentic-mooncake", "agentic_no_timestamp.jsonl", r"agentic_no_timestamp.jsonl:1: field 'timestamp': required on a row without wait_for"),
    ("agentic-mooncake", "agentic_dup.jsonl", r"agentic_dup.jsonl:2: field 'request_id': duplicate request_id \(first at line 1\), got 'a'"),
    ("agentic-mooncake", "agentic_tool_wait.jsonl", r"agentic_tool_wait.jsonl:2: field 'tool_wait_ms': expected a finite number >= 0, got -5"),
    ("agentic-mooncake", "agentic_wait_for.jsonl", r"agentic_wait_for.jsonl:1: field 'wait_for': expected a list of non-empty strings, got 'b'"),
]


@pytest.mark.parametrize("fmt, name, message", BAD, ids=[b[1] for b in BAD])
def test_malformed_rows_fail_with_file_line_field_and_value(fmt, name, message):
    with pytest.raises(TraceError, match=message):
        import_trace(fmt, DATA / "bad" / name, source_block_size=32 if fmt == "agentic-mooncake" else None)


@pytest.mark.parametrize("field", ["timestamp", "output_length"])
def test_a_json_integer_too_large_for_a_float_is_a_field_error(tmp_path, field):
    row = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], field: 10**400}
    (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=rf"m.jsonl:1: field '{field}': expected (a finite number >= 0|an integer "
                                         rf"from 0 to 1,000,000,000), got 1000000000"):
        import_trace("mooncake", tmp_path / "m.jsonl")


@pytest.mark.parametrize("data, message", [
    ("\ufeff{}".encode("utf-16"), r"m.jsonl:1: the file is UTF-16 \(it starts with a byte-order mark\)"),
    (b"\x80{}\n", r"m.jsonl:1: not UTF-8 text \(byte 0x80 at column 1\)"),
    (b'{"timestamp": 0}\n{"timest', r"m.jsonl:2: not valid JSON .*the file ends inside this line \(its writer "
                                     r"killed while writing\?\)$"),  # no `pbkv trace repair` hint: not a pbkv file
], ids=["utf-16", "not-utf-8", "cut"])
def test_unreadable_bytes_fail_with_file_and_line_as_in_the_native_reader(tmp_path, data, message):
    (tmp_path / "m.jsonl").write_bytes(data)
    with pytest.raises(TraceError, match=message):
        import_trace("mooncake", tmp_path / "m.jsonl")


def test_limit_stops_before_a_bad_line_past_it(tmp_path):
    good = open(DATA / "mooncake.jsonl").readline()
    (tmp_path / "m.jsonl").write_text(good + "{not json\n")
    trace, report = import_trace("mooncake", tmp_path / "m.jsonl", limit=1)
    assert report.rows == 1 and len(trace.calls) == 1


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_a_file_without_rows_is_an_error_not_an_empty_trace(tmp_path, text):
    (tmp_path / "e.jsonl").write_text(text)
    with pytest.raises(TraceError, match=r"e.jsonl: no bailian rows to import"):
        import_trace("bailian", tmp_path / "e.jsonl")


def test_limit_keeps_the_first_rows_and_reports_links_past_the_cut():
    trace, report = import_trace("mooncake", DATA / "mooncake.jsonl", limit=3)
    assert report.rows == 3 and [c.workflow_id for c in trace.calls] == ["mooncake-1", "mooncake-2", "mooncake-4"]
    trace, report = import_trace("bailian", DATA / "bailian.jsonl", limit=2)
    assert len(trace.calls) == 2 and not report.dropped_edges
    # a dependency on a row that is not in the file: an error, unless --limit may have cut it
    trace, report = import_trace("agentic-mooncake", DATA / "bad" / "agentic_unknown_dep.jsonl",
                                 source_block_size=32, limit=10)
    assert [(e.src, e.dst, e.kind) for e in report.dropped_edges] == [("nope", "b", "dangling")]
    assert [c.step for c in trace.calls] == [0, 1]


@pytest.mark.parametrize("fmt", ["mooncake", "bailian"])
def test_gzip_input_reads_like_plain(tmp_path, fmt):
    src = DATA / f"{fmt}.jsonl"
    gz = tmp_path / f"{fmt}.jsonl.gz"
    with open(src, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    a, _ = import_trace(fmt, src)
    b, _ = import_trace(fmt, gz)
    assert [(c.workflow_id, c.step, c.hash_ids) for c in a.calls] == [(c.workflow_id, c.step, c.hash_ids) for c in b.calls]


def test_block_size_split_and_merge_keep_sharing_exact():
    # 512 -> 256: lines 1 and 2 share two 512-blocks, i.e. four 256-blocks, and nothing after
    trace, _ = import_trace("mooncake", DATA / "mooncake.jsonl", block_size=256)
    a, b = trace.calls[0].hash_ids, trace.calls[1].hash_ids
    assert len(a) == 5 and len(b) == 6 and a[:4] == b[:4] and a[4] != b[4]
    # 16 -> 32 (bailian): a 32-block is shared iff both its 16-blocks are
    trace, _ = import_trace("bailian", DATA / "bailian.jsonl", block_size=32)
    wf = trace.workflows()["bailian-10"]
    assert [len(c.hash_ids) for c in wf] == [2, 3, 3, 3]
    # raw [100,101|102] (40 tokens) vs [100,101|102,104|105]: the short prompt's last 32-block holds
    # only one 16-block, so it is not the other's second block
    assert wf[1].hash_ids[0] == wf[0].hash_ids[0] and wf[1].hash_ids[1] != wf[0].hash_ids[1]
    assert wf[2].hash_ids[:2] == wf[3].hash_ids[:2] and wf[2].hash_ids[2] != wf[3].hash_ids[2]


def test_block_sizes_that_do_not_divide_share_only_what_the_source_proves():
    # source 4-token blocks, target 3: prompts share source blocks 0..1 (tokens 0..7)
    chain = Rechainer(4, 3)
    a = chain.convert([1, 2, 3], 12)
    b = chain.convert([1, 2, 9], 12)
    # target blocks [0,3) [3,6) lie in shared tokens; [6,9) crosses into the differing block
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    validate(Trace(TraceMeta(block_size=3), [Call("a", 0, "x", 12, 1, a), Call("b", 0, "x", 12, 1, b)]))


def test_round_trip_export_then_import_keeps_workflows_agents_lengths_waits_and_sharing(tmp_path):
    original = generate(load_spec("swe"), 5, 3)
    src = write_trace(original, tmp_path / "swe.jsonl")
    report = export_file("agentic-mooncake", src, tmp_path / "swe.agentic.jsonl.gz")
    assert report.rows == len(original.calls) and report.block_size == original.block_size
    back, imp = import_file("agentic-mooncake", tmp_path / "swe.agentic.jsonl.gz", tmp_path / "back.jsonl",
                            source_block_size=report.block_size)
    assert not imp.dropped_edges and not imp.notes
    back = read_trace(tmp_path / "back.jsonl")
    assert back.block_size == original.block_size
    wa, wb = original.workflows(), back.workflows()
    assert list(wa) == list(wb)
    for wf in wa:
        fields = lambda c: (c.step, c.agent, c.workload, c.input_length, c.output_length, bool(c.done))
        assert [fields(c) for c in wa[wf]] == [fields(c) for c in wb[wf]]
        assert [c.tool_wait or 0.0 for c in wb[wf]] == pytest.approx([c.tool_wait or 0.0 for c in wa[wf]], abs=1e-6)
    order = lambda t: [c for wf in t.workflows().values() for c in wf]
    assert canonical(order(back)) == canonical(order(original))
    assert any(c.tool_wait for c in original.calls)  # the check above saw real waits


def test_export_writes_dynamo_rows(tmp_path):
    trace, _ = import_trace("agentic-mooncake", DATA / "agentic.jsonl", source_block_size=32)
    src = write_trace(trace, tmp_path / "a.jsonl")
    export_file("agentic-mooncake", src, tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows[0]["request_id"] == "root:0" and rows[0]["wait_for"] == [] and rows[0]["prefix_reset"] is True
    r2 = rows[2]
    assert (r2["request_id"], r2["wait_for"], r2["delay"], r2["tool_wait_ms"], r2["timestamp"]) == \
        ("root:1", ["root:0"], 20.0, 230.0, 400.0)
    assert "tool_wait_ms" not in rows[3] and rows[3]["delay"] == 40.0


def test_registry_names_and_unknown_format():
    assert set(FORMATS) == {"mooncake", "bailian", "agentic-mooncake"}
    with pytest.raises(TraceError, match=r"cannot read format 'nope' \(formats that can: mooncake, bailian, agentic-mooncake\)"):
        import_trace("nope", DATA / "mooncake.jsonl")


runner = CliRunner()


def test_cli_import_and_export(tmp_path):
    out = tmp_path / "m.jsonl"
    r = runner.invoke(app, ["trace", "import", "--from", "mooncake", str(DATA / "mooncake.jsonl"), "-o", str(out),
                            "--limit", "2", "--block-size", "256"])
    assert r.exit_code == 0, r.output
    assert "imported 2 calls of 2 workflows from 2 mooncake rows (block size 512 -> 256)" in r.output
    assert read_trace(out).block_size == 256
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(out), "-o", str(tmp_path / "e.jsonl")])
    assert r.exit_code == 0 and "wrote 2 agentic-mooncake rows of 2 workflows" in r.output
    r = runner.invoke(app, ["trace", "import", "--from", "bailian", str(DATA / "bad" / "bailian_dup.jsonl"),
                            "-o", str(tmp_path / "x.jsonl")])
    assert r.exit_code == 1 and re.search(r"bailian_dup.jsonl:2: field 'chat_id'", r.output.replace("\n", ""))
    empty = tmp_path / "empty.jsonl"                  # metadata only: an export no import could read back
    empty.write_text('{"pbkv_trace": 1, "block_size": 16}\n')
    r = runner.invoke(app, ["trace", "export", "--to", "agentic-mooncake", str(empty), "-o", str(tmp_path / "f.jsonl")])
    assert r.exit_code == 1 and "empty.jsonl: no calls to export" in r.output and not (tmp_path / "f.jsonl").exists()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6), st.data())
def test_rechained_ids_are_chained_and_share_exactly_what_the_source_proves(source, block, raws, data):
    prompts = [(raw, data.draw(st.integers((len(raw) - 1) * source + 1, len(raw) * source))) for raw in raws]
    chain = Rechainer(source, block)
    outs = [chain.convert(raw, length) for raw, length in prompts]
    validate(Trace(TraceMeta(block_size=block),
                   [Call(f"w{i}", 0, "a", length, 1, out) for i, ((_, length), out) in enumerate(zip(prompts, outs))]))
    end = lambda j, length: min((j + 1) * block, length)  # one past block j's last token
    for (rx, lx), ox in zip(prompts, outs):
        for (ry, ly), oy in zip(prompts, outs):
            for j in range(min(len(ox), len(oy))):
                s = (end(j, lx) - 1) // source  # the source block holding block j's last token
                assert (ox[j] == oy[j]) == (end(j, lx) == end(j, ly) and rx[:s + 1] == ry[:s + 1])


def test_agentic_import_export_import_is_identical(tmp_path):
    first, _ = import_trace("agentic-mooncake", DATA / "agentic.jsonl", source_block_size=32)
    export_file("agentic-mooncake", write_trace(first, tmp_path / "a.jsonl"), tmp_path / "b.jsonl")
    second, report = import_trace("agentic-mooncake", tmp_path / "b.jsonl", source_block_size=32)
    # the spawn/join edges were reported by the first import; pbkv's trace (and so the export) no longer has them
    assert not report.dropped_edges
    key = lambda c: (c.workflow_id, c.step, c.agent, c.workload, c.t, c.input_length, c.output_length, c.done, c.extra)
    assert [key(c) for c in second.calls] == [key(c) for c in first.calls]
    assert canonical(second.calls) == canonical(first.calls)  # ids renumbered, sharing the same
    assert [c.tool_wait or 0 for c in second.calls] == pytest.approx([c.tool_wait or 0 for c in first.calls])


def test_agentic_row_without_session_is_its_own_workflow(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"request_id": "solo", "timestamp": 5, "input_length": 10, "output_length": 1,
                                "hash_ids": [3]}) + "\n")
    trace, _ = import_trace("agentic-mooncake", path, source_block_size=16)
    assert [(c.workflow_id, c.agent, c.t, c.done) for c in trace.calls] == [("solo", "main", 0.005, True)]


@pytest.mark.parametrize("fmt, options", [("mooncake", {"block_size": 256}), ("bailian", {}),
                                          ("bailian", {"block_size": 32}),
                                          ("agentic-mooncake", {"source_block_size": 32, "block_size": 8})])
def test_imported_prompts_fit_the_radix_tree(fmt, options):
    # a partial last block must never reappear as a full block of a longer prompt: the tree cannot extend it
    trace, _ = import_trace(fmt, DATA / f"{fmt.split('-')[0]}.jsonl", **options)
    tree = RadixTree(trace.block_size)
    for i, call in enumerate(trace.calls):
        tree.insert(call.hash_ids, call.block_tokens(trace.block_size)[-1], Tier.DEVICE, float(i))
