"""pbkv.serve pieces without a server: tokenizer and stop strings, workflow table, schemas,
metrics text, trace recorder."""

import pytest
from pydantic import ValidationError

pytest.importorskip("fastapi")

from pbkv.serve.errors import pydantic_errors  # noqa: E402
from pbkv.serve.metrics import Metrics, parse  # noqa: E402
from pbkv.serve.recorder import TraceRecorder  # noqa: E402
from pbkv.serve.schemas import ChatRequest, CompletionRequest  # noqa: E402
from pbkv.serve.tokenizer import ByteTokenizer, Detokenizer  # noqa: E402
from pbkv.serve.workflows import OTHER_AGENT, Hints, WorkflowTable  # noqa: E402
from pbkv.trace import DEFAULT_AGENT, Call, read_trace  # noqa: E402

TOK = ByteTokenizer(512)


def run_detok(text: str, stops: list[str]) -> tuple[str, bool]:
    d = Detokenizer(TOK, stops)
    out = ""
    for t in TOK.encode(text):
        out += d.push(t)
        if d.stopped:
            break
    return out + d.finish(), d.stopped


def test_byte_tokenizer_round_trip_and_chat_prefix():
    s = "héllo → wörld 🙂"
    assert TOK.decode(TOK.encode(s)) == s
    a = TOK.chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "one"}])
    b = TOK.chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "one two"}])
    assert a[0] == ByteTokenizer.BOS and b[:len(a) - 20] == a[:len(a) - 20]  # later turns share the prefix
    assert all(0 <= t < 512 for t in a)
    with pytest.raises(ValueError, match="vocabulary"):
        ByteTokenizer(100)


def test_detokenizer_stops_and_holds_back():
    assert run_detok("hello world", ["wor"]) == ("hello ", True)
    assert run_detok("hello world", ["xyz"]) == ("hello world", False)
    assert run_detok("abcabd", ["abd"]) == ("abc", True)   # a false start is released, not lost
    assert run_detok("ab", ["abc"]) == ("ab", False)         # held back, released at the end
    # multi-byte characters are never split across pushes
    d = Detokenizer(TOK, [])
    pieces = [d.push(t) for t in TOK.encode("é🙂")]
    assert "".join(pieces) == "é🙂" and all("\ufffd" not in p for p in pieces)


def test_workflow_table_lifecycle():
    t = WorkflowTable(idle_timeout=10.0, session="s")
    r1, step, new = t.begin(Hints("a", "router"), now=0.0)
    assert (step, new) == (0, True)
    r1b, step, new = t.begin(Hints("a", "coder"), now=1.0)
    assert r1b is r1 and (step, new) == (1, False)
    assert not t.finish(r1, 2.0) and not t.finish(r1, 3.0)          # hinted: stays open
    assert t.expired(12.0) == [] and t.expired(13.5) == [r1]          # idle > 10 s by the clock
    assert r1.ending == "idle"
    t.remove(r1)
    r2, step, new = t.begin(Hints("a"), now=20.0)                     # same id later: a new run
    assert new and step == 0 and r2.workflow != r1.workflow and r2.record_id != r1.record_id
    assert r2.agents == [DEFAULT_AGENT] and r2.workflow_id == "a"
    # an end request while a call is in flight ends the run when that call finishes
    assert t.request_end("a") is None
    assert t.finish(r2, 21.0) and r2.ending == "endpoint"
    t.remove(r2)
    with pytest.raises(KeyError):
        t.request_end("a")
    # one-call runs end right after their call; `done` marks the last call
    r3, _, _ = t.begin(Hints(), now=30.0)
    assert t.finish(r3, 31.0) and r3.ending == "single"
    r4, _, _ = t.begin(Hints("b", "x", done=True), now=30.0)
    r5, _, new = t.begin(Hints("b", "x"), now=30.5)
    assert new and r5 is not r4 and t.finish(r4, 31.0) and r4.ending == "done"
    t.remove(r3)
    t.remove(r4)
    assert t.ended == {"done": 1, "endpoint": 1, "idle": 1, "single": 1, "shutdown": 0}
    assert t.all_live() == [r5] and r5.ending == "shutdown"
    with pytest.raises(ValueError):
        WorkflowTable(idle_timeout=0)


def test_workflow_table_caps_agent_names():
    t = WorkflowTable(idle_timeout=10.0, session="s", max_agents=2)
    run, _, _ = t.begin(Hints("w", "a"), now=0.0)
    for agent in ("b", "c", "a", None, "d", "b"):
        t.begin(Hints("w", agent), now=0.0)
    assert run.agents == ["a", "b", OTHER_AGENT, "a", DEFAULT_AGENT, OTHER_AGENT, "b"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_chat_request_rejects_with_param(body, param):
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate(body)
    err = pydantic_errors(e.value)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"


def test_request_shapes_accepted():
    r = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "stop": "x", "workflow_id": "w",
        "agent": "a", "workflow_done": True, "logit_bias": {}, "user": "u"})
    assert r.messages[0].text() == "ab" and r.stops() == ["x"] and r.workflow_done
    c = CompletionRequest.model_validate({"model": "m", "prompt": ["only one"]})
    assert c.prompt == "only one" and CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompt == [5, 6]
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})


def test_metrics_text():
    from prometheus_client.core import GaugeMetricFamily
    m = Metrics()
    m.requests.labels(endpoint="/x", status="200").inc()
    m.requests.labels(endpoint="/x", status="200").inc(2)
    m.latency.observe(0.2)
    m.served(10, 3, {"device": 4, "host": 1, "disk": 0}, 5, cancelled=True)
    text = m.exposition([GaugeMetricFamily("pbkv_queue_depth", "q", value=3)]).decode()
    values = parse(text)
    assert values['pbkv_requests_total{endpoint="/x",status="200"}'] == 3
    assert values['pbkv_request_latency_seconds_bucket{le="0.25"}'] == 1
    assert values["pbkv_request_latency_seconds_count"] == 1 and values["pbkv_queue_depth"] == 3
    assert values['pbkv_cache_hit_tokens_total{tier="device"}'] == 4 and values["pbkv_cancelled_requests_total"] == 1
    assert "# TYPE pbkv_request_latency_seconds histogram" in text and "_created" not in text
    assert m.hit_rates() == {"device": 0.4, "host": 0.1, "disk": 0.0, "shared": 0.0}
    assert Metrics().hit_rates() == {"device": 0.0, "host": 0.0, "disk": 0.0, "shared": 0.0}   # one registry per server


def test_recorder_writes_valid_rotating_traces(tmp_path):
    from pbkv.engine.hf.tokens import block_hashes
    rec = TraceRecorder(tmp_path, "sess", 4, "tiny", rotate_calls=3)
    for w in range(3):
        calls = []
        for step in (1, 0):  # any order in, step order out
            ids = list(range(1, 10 + step * 4))
            calls.append(Call(f"sess-{w}", step, "a", len(ids), 2, block_hashes(ids, 4)))
        rec.record(calls)
    rec.close()
    assert [p.name for p in rec.files] == ["calls-sess-00000.jsonl", "calls-sess-00001.jsonl"]
    traces = [read_trace(p) for p in rec.files]
    assert sum(len(t.calls) for t in traces) == 6 and traces[0].block_size == 4
    for t in traces:
        for calls in t.workflows().values():
            assert [c.step for c in calls] == [0, 1] and calls[-1].done and not calls[0].done


def test_a_union_fields_error_is_its_deepest_branchs():
    from pbkv.serve import schemas
    image = {"model": "t", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    for cls, body, param, says in [
            (schemas.ChatRequest, image, "messages.0.content.0.type", "Input should be 'text'"),
            (schemas.CompletionRequest, {"model": "t", "prompt": [True]}, "prompt.0", "valid integer")]:
        with pytest.raises(ValidationError) as e:
            cls.model_validate(body)
        err = pydantic_errors(e.value)
        assert (err.status, err.param) == (400, param) and says in err.message, err.message
