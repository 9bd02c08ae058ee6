"""HTTP fuzz test against a live `pbkv serve` (issue 14): generated bodies from the request
schemas (every field of `ChatRequest` / `CompletionRequest`, each either a plausible or a hostile
value) plus raw bodies and the reported defect cases. Assertions: never a 5xx, never a hang
(bounded client timeouts), every error in the OpenAI shape, a normal request answered afterwards.
Derandomized (the same cases on every run) and bounded (`MAX_EXAMPLES`)."""

import collections
import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_helpers import start_server, torch_threads  # noqa: F401

MAX_EXAMPLES = 200
STATUS = collections.Counter()   # figures for the closing note: status -> count

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "ok\ud83d"])
TEXT = st.one_of(st.text(max_size=40), SURROGATES, st.sampled_from(["", " ", "\x00", "é" * 30, "🙂"]))
NUMBER = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1, 2, -1, 1e-300, 5e-324, 1e-45, 2**63, 2**64, 18446744073709551616]))
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=10)


def schema_bodies(hostile: bool):
    """(chat, completion) body strategies: every schema field plausible, or (`hostile`) each field
    sometimes anything at all."""
    def field(good):
        return st.one_of(good, good, JUNK) if hostile else good
    part = st.fixed_dictionaries({"type": field(st.just("text")), "text": field(TEXT)})
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]))},
        optional={"content": field(st.one_of(TEXT, st.lists(part, max_size=3), st.none())), "name": field(TEXT)})
    common = {
        "max_tokens": field(st.integers(-2 if hostile else 1, 12)), "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0, 1, exclude_min=not hostile)), "n": field(st.integers(0, 2) if hostile else
                                                                              st.just(1)),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
        "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=5))), "seed": field(NUMBER),
        "ignore_eos": field(st.booleans()), "workflow_id": field(TEXT), "agent": field(TEXT),
        "workflow_done": field(st.booleans()), "user": JUNK, "presence_penalty": JUNK,
    }
    model = field(st.sampled_from(["tiny", "tiny", "tiny", "other"]))
    chat = st.fixed_dictionaries(
        {"model": model, "messages": field(st.lists(message, min_size=1, max_size=3))},
        optional={**common, "max_completion_tokens": field(st.integers(-1, 12)), "logprobs": field(st.booleans()),
                  "top_logprobs": field(st.integers(0, 3)), "logit_bias": field(st.just({})),
                  "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
                  "tool_choice": field(st.sampled_from(["auto", "none", "required"]))})
    completion = st.fixed_dictionaries(
        {"model": model, "prompt": field(st.one_of(TEXT, st.lists(st.integers(-3, 300), max_size=8),
                                                   st.lists(TEXT, max_size=2)))},
        optional={**common, "echo": field(st.booleans()), "logprobs": field(st.one_of(st.none(), st.integers(0, 3)))})
    return chat, completion


CHAT, COMPLETION = schema_bodies(hostile=True)
GOOD_CHAT, GOOD_COMPLETION = schema_bodies(hostile=False)
DEEP = st.integers(1, 3000).map(lambda d: '{"model":"tiny","prompt":' + "[" * d + "]" * d + "}")
RAW = st.one_of(st.binary(max_size=200), DEEP, st.text(max_size=100).map(str.encode),
                st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b'{"model":"tiny","prompt":"\\ud800"}',
                                 b'{"model":"tiny","prompt":"p","seed":18446744073709551616,"temperature":0.7}']))
CASE = st.one_of(st.tuples(st.just("/v1/chat/completions"), CHAT), st.tuples(st.just("/v1/completions"), COMPLETION),
                 st.tuples(st.just("/v1/chat/completions"), GOOD_CHAT),
                 st.tuples(st.just("/v1/completions"), GOOD_COMPLETION),
                 st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), RAW),
                 st.tuples(st.just("end"), TEXT))


@pytest.fixture(scope="module")
def srv(torch_threads):  # noqa: F811
    server = start_server(max_tokens_limit=16, default_max_tokens=4, header_timeout=5, body_timeout=5)
    yield server
    server.stop()
    print(f"\nfuzz: {sum(STATUS.values())} cases, status counts {dict(sorted(STATUS.items()))}")


def send(client: httpx.Client, path, payload) -> httpx.Response:
    if path == "end":   # POST /v1/workflows/{id}/end with any id (percent-encoded)
        return client.post(f"/v1/workflows/{quote(payload.encode('utf-8', 'surrogatepass'), safe='')}/end")
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        r.read()   # a stream is read to its end (bounded by the client timeout: never a hang)
        return r


def check(r: httpx.Response) -> None:
    STATUS[r.status_code] += 1
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text


def test_fuzz_never_a_5xx_never_a_hang(srv):
    client = httpx.Client(base_url=srv.url, timeout=30)

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(CASE)
    def one(case):
        check(send(client, *case))
    one()
    # ignore_eos: a sampled first token may be EOS (0 tokens), which says nothing about the server
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "still there?", "max_tokens": 3,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert srv.state.worker.in_flight == 0
    assert sum(STATUS.values()) >= MAX_EXAMPLES and any(s < 300 for s in STATUS) and any(s >= 400 for s in STATUS)
    client.close()
