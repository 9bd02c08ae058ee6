"""Issue 14, the server side: client mistakes are 400s (never 500s), sampling edge values work,
usage reports cached tokens, the queue limit answers 429 at exactly `max_queue`, an empty API key
is refused, slow clients are cut off."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from serve_helpers import on_engine, start_server, torch_threads  # noqa: F401

from pbkv.cache import Tier
from pbkv.cli import app as cli_app
from pbkv.policy.lru import LRUPolicy
from pbkv.serve import ServeConfig
from pbkv.serve.server import build_state

PROMPT = "The same long prompt, shared by the calls of one workflow. " * 4


@pytest.fixture(scope="module")
def srv(torch_threads):  # noqa: F811
    server = start_server(header_timeout=0.5, body_timeout=0.5)
    yield server
    server.stop()


def post(srv, path, body=None, content=None, timeout=60):
    return httpx.post(srv.url + path, json=body, content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def completion(srv, **fields):
    body = {"model": "tiny", "prompt": "p", "max_tokens": 8, "ignore_eos": True, **fields}
    return post(srv, "/v1/completions", body)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------- defect 1a: sampling at the edge

def test_a_seed_beyond_64_bits_is_mapped_not_a_failure(srv):
    r = completion(srv, temperature=0.7, seed=18446744073709551616, max_tokens=20)
    assert r.status_code == 200, r.text
    same = [completion(srv, temperature=0.7, seed=s).json()["choices"][0]["text"] for s in (5, 5 + 2**64, 5 + 2**63)]
    assert same[0] == same[1] == same[2]   # seeds are taken modulo 2**63
    assert completion(srv, temperature=0.7, seed=-1).status_code == 200


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 1e-45}, {"temperature": 5e-324},
                                    {"top_p": 1e-50, "temperature": 0.7}, {"top_p": 5e-324, "temperature": 0.7}])
def test_tiny_temperature_or_top_p_behaves_like_greedy(srv, fields):
    r = completion(srv, seed=3, **fields)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == completion(srv, temperature=0).json()["choices"][0]["text"]


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5),
                                         ("seed", 1.5), ("seed", "7")])
def test_sampling_parameters_out_of_range_are_400s_naming_the_param(srv, field, value):
    assert_openai_error(completion(srv, **{field: value}), 400, field)


# ---------------------------------------------------------------- an answer of another shape is a 400

def chat(srv, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return post(srv, "/v1/chat/completions", body)


@pytest.mark.parametrize("path,fields,param,says", [
    ("chat", {"logprobs": True}, "logprobs", "log probabilities are not returned"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "log probabilities are not returned"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", "'json_object' is not supported"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "'json_schema' is not supported"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "parses no tool calls"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "parses no tool calls"),
    ("chat", {"logit_bias": {"5": 100}}, "logit_bias", "logit_bias is not supported"),
    ("completion", {"logprobs": 0}, "logprobs", "log probabilities are not returned"),
    ("chat", {"functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": {"name": "f"}},
     "function_call", "this server parses no function calls: function_call may be 'auto' (the model answers in "
     "text) or 'none', not a named function"),
    ("completion", {"suffix": "\n    return c"}, "suffix",
     "suffix (insertion: text that follows the completion) is not supported by this server"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities",
     "this server answers in text only: modalities may hold only 'text'"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio",
     "audio output is not supported by this server (text only); leave out audio"),
])
def test_fields_that_would_change_the_answers_shape_are_400s(srv, path, fields, param, says):
    """Ignoring these would answer something else than what was asked (no log probabilities, no
    JSON, no tool call): a 400 naming the field, not a silent null or free text."""
    r = chat(srv, **fields) if path == "chat" else completion(srv, **fields)
    assert says in assert_openai_error(r, 400, param)["message"]


@pytest.mark.parametrize("path,fields", [
    ("chat", {"logprobs": False, "top_logprobs": 0}), ("chat", {"response_format": {"type": "text"}}),
    ("chat", {"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"tool_choice": "none"}), ("chat", {"logit_bias": {}}), ("chat", {"logprobs": None}),
    ("completion", {"logprobs": None}),
    ("chat", {"functions": [{"name": "f"}], "function_call": "auto"}), ("chat", {"function_call": "none"}),
    ("chat", {"modalities": ["text"]}), ("chat", {"audio": None}), ("completion", {"suffix": None}),
    ("completion", {"suffix": ""}),
])
def test_their_harmless_values_are_accepted(srv, path, fields):
    r = chat(srv, **fields) if path == "chat" else completion(srv, **fields)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- OpenAI's nullable fields, prompt shapes

@pytest.mark.parametrize("path", ["chat", "completion"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream"])
def test_null_sampling_fields_mean_the_default(srv, path, field):
    """OpenAI documents these as nullable (the `openai` client sends temperature=None as null);
    they were 400s ("should be a valid number")."""
    r = chat(srv, **{field: None}) if path == "chat" else completion(srv, **{field: None})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         temperature=None, top_p=None, n=None, stream=None)
    assert got.choices[0].finish_reason in ("stop", "length")


def test_null_echo_means_no_echo(srv):
    """`echo` is nullable in OpenAI's completions API; null was a 400 ("should be a valid boolean")."""
    r = completion(srv, echo=None, prompt="abc", temperature=0, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == completion(srv, prompt="abc", temperature=0, max_tokens=2).json()[
        "choices"][0]["text"]


def test_a_limit_error_names_max_completion_tokens_when_the_client_sent_it(srv):
    limit = srv.state.config.max_tokens_limit
    err = assert_openai_error(chat(srv, max_tokens=None, max_completion_tokens=limit + 1), 400,
                              "max_completion_tokens")
    assert err["message"] == f"max_completion_tokens is {limit + 1}; this server allows at most {limit}."
    err = assert_openai_error(chat(srv, max_tokens=limit + 1), 400, "max_tokens")
    assert err["message"] == f"max_tokens is {limit + 1}; this server allows at most {limit}."


def test_a_prompt_of_one_token_array_in_an_array_is_that_prompt(srv):
    one = completion(srv, prompt=[72, 73, 74], temperature=0, max_tokens=3)
    nested = completion(srv, prompt=[[72, 73, 74]], temperature=0, max_tokens=3)
    assert nested.status_code == 200, nested.text
    assert nested.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]
    assert nested.json()["usage"]["prompt_tokens"] == 3
    err = assert_openai_error(completion(srv, prompt=[[72], [73]]), 400, "prompt")
    assert "only one prompt per request is supported, got a batch of 2 prompts; send one request per prompt" \
        in err["message"]
    assert "must not be empty" in assert_openai_error(completion(srv, prompt=[[]]), 400, "prompt")["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("include", [True, False])
def test_streamed_chunks_carry_usage_null_before_the_usage_chunk(srv, path, include):
    """OpenAI's shape with include_usage: `"usage": null` on every chunk but the last, which has
    the usage and no choices; without include_usage, no usage key at all."""
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            **({"stream_options": {"include_usage": True}} if include else {}),
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
    chunks = []
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    if include:
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and len(chunks) > 2
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    else:
        assert not any("usage" in c for c in chunks)


# ---------------------------------------------------------------- defect 3: 400, not 500

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt.0"),
    ("/v1/completions", {"prompt": "p", "stop": ["\ud800"]}, "stop.0"),
    ("/v1/completions", {"prompt": "p", "\ud800": 1}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "workflow_id": "w\ud800"},
     "workflow_id"),
])
def test_a_lone_surrogate_anywhere_is_a_400(srv, path, body, param):
    content = json.dumps({"model": "tiny", **body})   # ensure_ascii: the surrogate travels as "\\ud800"
    assert "\\ud800" in content or "\\udfff" in content or "\\udc00" in content
    err = assert_openai_error(post(srv, path, content=content), 400, param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("depth", [65, 1000, 5000, 30_000])
def test_deeply_nested_json_is_a_400(srv, depth):
    content = '{"model":"tiny","prompt":"p","x":' + "[" * depth + "]" * depth + "}"
    err = assert_openai_error(post(srv, "/v1/completions", content=content), 400)
    assert "nested deeper" in err["message"]
    assert completion(srv, x=[[[]]]).status_code == 200   # a few levels of extras are fine


# ---------------------------------------------------------------- usage: cached tokens

def test_usage_reports_cached_tokens_per_tier(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    hints = {"workflow_id": "usage-wf", "ignore_eos": True}
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=hints)
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=hints)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    tiers = again.usage.model_extra["pbkv_cached_tokens"]
    assert 0 < cached < again.usage.prompt_tokens and tiers == {"device": cached, "host": 0, "disk": 0, "shared": 0}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == sum(chat.usage.model_extra["pbkv_cached_tokens"].values())
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body=hints))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == cached and usage.model_extra["pbkv_cached_tokens"] == tiers


# ---------------------------------------------------------------- the queue limit

def test_the_queue_limit_answers_429_at_exactly_max_queue(srv):
    """The engine thread is held, so submitted jobs stay in flight: with max_queue 2, the second
    request is taken (1 in flight), the third is refused (2 in flight) with Retry-After."""
    worker, release, held = srv.state.worker, threading.Event(), threading.Event()
    srv.state.config.max_queue = 2
    counted = threading.Semaphore(0)
    original = worker._count

    def count(delta):
        original(delta)
        if delta > 0:
            counted.release()
    worker._count = count
    worker.call(lambda: (held.set(), release.wait(60)))
    try:
        assert held.wait(30)
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(completion(srv).status_code)) for _ in range(2)]
        for t in threads:
            t.start()
            assert counted.acquire(timeout=30)      # in flight: 1, then 2
        r = completion(srv)
        err = assert_openai_error(r, 429)
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
    finally:
        release.set()
        worker._count = original
        srv.state.config.max_queue = 1024
    for t in threads:
        t.join(60)
    assert answers == [200, 200] and worker.in_flight == 0


# ---------------------------------------------------------------- defect 9: an empty API key

def test_an_empty_api_key_is_refused_at_start(monkeypatch):
    with pytest.raises(ValueError, match="empty"):
        build_state(ServeConfig(api_key=""))
    with pytest.raises(ValueError, match="empty"):
        build_state(ServeConfig(api_key="  "))
    runner = CliRunner()
    for args, env in ((["serve", "--api-key", ""], {}), (["serve"], {"PBKV_API_KEY": ""})):
        r = runner.invoke(cli_app, args, env=env)
        assert r.exit_code == 2 and "empty" in r.output, r.output


# ---------------------------------------------------------------- defect 4: slow clients

def _raw(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP response (headers, then Content-Length bytes): a recv may return the
    headers alone, and what it leaves must not be read as the next response."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_slow_headers_and_slow_bodies_are_cut_off_while_others_are_served(srv):
    start = time.monotonic()
    silent, slow_head, slow_body = _raw(srv), _raw(srv), _raw(srv)
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")          # headers never finish
    body = json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 2}).encode()
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body[:5])    # body never finishes
    assert completion(srv).status_code == 200                                 # others are served meanwhile
    assert _read_all(silent).startswith(b"HTTP/1.1 408")
    head_answer = _read_all(slow_head)
    assert head_answer.startswith(b"HTTP/1.1 408")
    assert json.loads(head_answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    answer = _read_all(slow_body)
    assert answer.startswith(b"HTTP/1.1 408")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5                                       # timeouts are 0.5 s
    for s in (silent, slow_head, slow_body):
        s.close()
    assert completion(srv).status_code == 200


def test_a_kept_alive_connection_gets_a_fresh_header_timeout(srv):
    s = _raw(srv)
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    for _ in range(2):
        s.sendall(request)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\n")              # then stalls mid-headers
    assert _read_all(s).startswith(b"HTTP/1.1 408")
    s.close()


# ---------------------------------------------------------------- defect 1: one bad request among many

def _co_run(srv, bodies: list[dict], refused: int = 0) -> list[httpx.Response]:
    """POST every body to /v1/completions so that all are in flight before the engine runs any:
    the engine thread is held until the last one was submitted (they share one batch);
    `refused`: how many the HTTP layer answers itself (never submitted)."""
    worker, release, held = srv.state.worker, threading.Event(), threading.Event()
    counted, original = threading.Semaphore(0), worker._count

    def count(delta):
        original(delta)
        if delta > 0:
            counted.release()
    worker._count = count
    worker.call(lambda: (held.set(), release.wait(60)))
    answers: list = [None] * len(bodies)

    def send(i):
        answers[i] = post(srv, "/v1/completions", {"model": "tiny", "ignore_eos": True, **bodies[i]})
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    try:
        assert held.wait(30)
        for t in threads:
            t.start()
        for _ in range(len(bodies) - refused):
            assert counted.acquire(timeout=30)
    finally:
        worker._count = original
        release.set()
    for t in threads:
        t.join(60)
    return answers


NORMAL = [{"prompt": f"normal request {i}", "max_tokens": 24, "temperature": 0} for i in range(4)]


def _solo(srv) -> list[str]:
    return [post(srv, "/v1/completions", {"model": "tiny", "ignore_eos": True, **b}).json()["choices"][0]["text"]
            for b in NORMAL]


def _assert_nothing_held(srv):
    engine = on_engine(srv, lambda: srv.state.worker.engine)
    assert srv.state.worker.in_flight == 0
    assert on_engine(srv, lambda: (engine.cache.reserved, list(engine.cache.locked), engine.busy)) == (0, [0, 0, 0],
                                                                                                      False)
    assert all(run.in_flight == 0 for run in on_engine(srv, lambda: list(srv.state.worker.table.all_live())))


def test_the_issue_requests_among_normal_ones(srv):
    solo = _solo(srv)
    bad = [{"prompt": "p", "max_tokens": 200, "temperature": 0.7, "seed": 18446744073709551616},
           {"prompt": "p", "max_tokens": 50, "temperature": 0.7, "top_p": 1e-50},
           {"prompt": "p", "max_tokens": 50, "temperature": 1e-45},
           {"prompt": "p", "max_tokens": 50, "temperature": 3.0}]
    answers = _co_run(srv, NORMAL[:2] + bad + NORMAL[2:], refused=1)
    assert [a.status_code for a in answers] == [200] * 5 + [400] + [200, 200]
    assert answers[5].json()["error"]["param"] == "temperature"
    texts = [a.json()["choices"][0]["text"] for a in answers[:2] + answers[-2:]]
    assert texts == solo
    _assert_nothing_held(srv)


def test_with_validation_bypassed_the_engine_still_isolates_the_failure(srv, monkeypatch):
    """The old failure (multinomial on a NaN distribution) forced for one request's sampling:
    it alone gets a 500 naming the error; the others are answered as if it were not there."""
    import pbkv.engine.hf.execute as execute
    real, marker = execute.sample, 0.987654

    def sample(logits, temperature, top_p, gen):
        if top_p == marker:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return real(logits, temperature, top_p, gen)
    solo = _solo(srv)
    monkeypatch.setattr(execute, "sample", sample)
    bad = {"prompt": "p", "max_tokens": 100, "temperature": 0.7, "top_p": marker, "workflow_id": "bad-wf"}
    answers = _co_run(srv, NORMAL[:2] + [bad] + NORMAL[2:])
    err = assert_openai_error(answers[2], 500)
    assert err["code"] == "engine_error" and "invalid multinomial" in err["message"]
    ok = answers[:2] + answers[3:]
    assert [a.status_code for a in ok] == [200] * 4
    assert [a.json()["choices"][0]["text"] for a in ok] == solo
    _assert_nothing_held(srv)


def test_open_connections_are_capped(srv):
    """uvicorn's `limit_concurrency` (--max-connections): with 2 connections open, a third's
    request gets 503 while they stay; once they are gone requests are served again."""
    config = srv.server.config
    protocol = config.http_protocol_class
    config.limit_concurrency, protocol.header_timeout = 3, 30.0   # read by each new connection
    try:
        held = [_raw(srv) for _ in range(2)]
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")     # mid-headers, holding the connection
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        for s in held:
            s.close()
    finally:
        config.limit_concurrency, protocol.header_timeout = srv.cfg.max_connections, srv.cfg.header_timeout
    assert completion(srv).status_code == 200


def test_a_failure_of_shared_state_still_answers_every_job(srv, monkeypatch):
    """A policy hook raising while a request ends (shared state: not isolated per request) leaves
    that request ended in the engine but unanswered; the worker still answers it (500) and frees
    its in-flight count and workflow, and the server goes on."""
    policy = srv.state.worker.engine.policy
    real, calls = policy.on_call_end, []

    def on_call_end(event):
        if not calls:
            calls.append(event)
            raise RuntimeError("policy hook failed")
        return real(event)
    monkeypatch.setattr(policy, "on_call_end", on_call_end)
    err = assert_openai_error(completion(srv, workflow_id="hook-wf"), 500)
    assert err["code"] == "engine_error" and "policy hook failed" in err["message"]
    assert completion(srv).status_code == 200
    _assert_nothing_held(srv)


def _count(srv, status: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pbkv_requests_total{") and f'status="{status}"' in line)


def test_a_client_gone_mid_body_is_no_server_error(srv):
    before = _count(srv, "500")
    for _ in range(3):
        s = _raw(srv)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n" + b'{"model":"')
        s.close()                                        # gone before the body's last 90 bytes
    deadline = time.monotonic() + 10
    while _count(srv, "499") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count(srv, "499") >= 3 and _count(srv, "500") == before
    assert completion(srv).status_code == 200


class BrokenPolicy(LRUPolicy):
    """A policy whose prediction step raises from the third call end on (a bug, as the retrain
    crash was): the server must go on ranking by LRU, not fail the calls in flight."""

    name = "broken"
    ends = 0

    def priority(self, node):
        return (0, node.last_access)

    def on_call_end(self, event):
        BrokenPolicy.ends += 1
        if BrokenPolicy.ends >= 3:
            raise IndexError("list index out of range")


def test_a_policy_that_raises_is_replaced_by_lru_and_no_call_fails(torch_threads):  # noqa: F811
    server = start_server(policy="test_serve_reliability:BrokenPolicy")
    try:
        answers = []

        def ask(i):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"call {i} " + PROMPT, "max_tokens": 6, "ignore_eos": True,
                "workflow_id": f"w{i % 3}", "agent": "a"})
            answers.append(r.status_code)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers == [200] * 8
        metrics = httpx.get(server.url + "/metrics").text
        assert "pbkv_policy_fallbacks_total 1.0" in metrics
        engine = server.state.worker.engine
        assert on_engine(server, lambda: (engine.policy.name, engine.cache.rules is engine.policy)) == ("lru", True)
        assert on_engine(server, lambda: all(n.key == engine.policy.priority(n)
                                             for n in engine.cache.candidates(Tier.DEVICE)))
    finally:
        server.stop()
