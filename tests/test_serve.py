"""`pbkv serve` end to end: the real server (uvicorn, tiny model) driven by the `openai` client and
raw HTTP: answers, streams, stop strings, every error shape, API key, metrics, disconnects."""

import json
import threading
import time

import httpx
import openai
import pytest

from serve_helpers import FakeClock, on_engine, start_server, torch_threads, watch_counter  # noqa: F401

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def srv(torch_threads, tmp_path_factory):  # noqa: F811
    clock = FakeClock()
    server = start_server(clock=clock, record=str(tmp_path_factory.mktemp("rec")), policy="pbkv")
    server.clock = clock
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(srv, path, body=None, content=None, headers=None):
    return httpx.post(srv.url + path, json=body, content=content, headers=headers, timeout=60)


def sse(srv, path, body) -> list:
    """The data lines of a streamed answer, parsed (the final '[DONE]' kept as a string)."""
    out = []
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_and_metrics(srv, client):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok", "model": "tiny", "policy": "pbkv"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("pbkv_cache_hit_rate{tier=\"device\"}", "pbkv_cache_hit_rate{tier=\"disk\"}", "pbkv_queue_depth",
                 "pbkv_cache_evictions_total", "pbkv_prefetched_tokens_total", "pbkv_predictor_accuracy",
                 "pbkv_active_workflows"):
        assert name in r.text


def test_chat_and_completion(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    again = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy, now from the cache
    c = client.completions.create(model="tiny", prompt="The cat", max_tokens=5, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and c.choices[0].text.startswith("The cat")
    assert c.usage.prompt_tokens == len("The cat") and c.usage.completion_tokens == 5
    sampled = client.completions.create(model="tiny", prompt="The cat", max_tokens=5, temperature=1.0, seed=7,
                                        top_p=0.9, extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == client.completions.create(
        model="tiny", prompt="The cat", max_tokens=5, temperature=1.0, seed=7, top_p=0.9,
        extra_body={"ignore_eos": True}).choices[0].text  # a seed makes sampling repeatable


def test_streams_match_plain_answers(srv, client):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    events = sse(srv, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-3]) == plain
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 7
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    events = sse(srv, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_strings(srv, client):
    full = client.completions.create(model="tiny", prompt="stop test", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    expect = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt="stop test", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    events = sse(srv, "/v1/completions", {"model": "tiny", "prompt": "stop test", "max_tokens": 16, "temperature": 0,
                                          "stop": stop, "stream": True, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expect
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


BAD = [  # (path, json body or raw bytes, headers, status, code, param)
    ("/v1/chat/completions", b"{not json", None, 400, "invalid_json", None),
    ("/v1/chat/completions", b"[1, 2]", None, 400, "invalid_json", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": "5"}, None, 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stream": "yes"}, None, 400, "invalid_value", "stream"),
    ("/v1/chat/completions", {"model": "tiny"}, None, 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, None, 404, "model_not_found", "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 2}, None, 400, "invalid_value", "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 1025}, None, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 8190, "max_tokens": 8}, None, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 8300}, None, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 70_000}, None, 413, "request_too_large", None),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, None, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, None, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x"}, {"X-Workflow-Id": "w" * 300}, 400, "invalid_value", "x-workflow-id"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "workflow_id": ""}, None, 400, "invalid_value", "workflow_id"),
    ("/v1/workflows/never-started/end", None, None, 404, "workflow_not_found", "workflow_id"),
    ("/v1/nothing-here", {}, None, 404, "not_found", None),
]


@pytest.mark.parametrize("path, body, headers, status, code, param", BAD)
def test_bad_requests_get_openai_errors(srv, path, body, headers, status, code, param):
    raw = body if isinstance(body, bytes) else None
    r = post(srv, path, None if raw else body, content=raw, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    assert httpx.get(srv.url + "/health").status_code == 200  # and the server keeps serving


def test_wrong_method_and_client_side_errors(srv, client):
    r = httpx.get(srv.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=5)
    assert e.value.param == "temperature"


def test_api_key(srv):
    srv.state.config.api_key = "sekret"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).object == "text_completion"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.state.config.api_key = None


def test_disconnect_mid_stream_frees_resources(srv):
    cancelled = watch_counter(srv.state.metrics.cancelled)
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 1000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived: hang up
    assert cancelled.wait(30), "the server did not cancel the abandoned stream"
    worker = srv.state.worker
    state = on_engine(srv, lambda: (len(worker.jobs), worker.engine.running_count, worker.engine.queue_depth,
                                    worker.engine.cache.reserved))
    assert state == (0, 0, 0, 0)
    assert srv.state.worker.in_flight == 0
    assert httpx.get(srv.url + "/health").status_code == 200


def test_disconnect_while_waiting_for_a_plain_answer_cancels_it(srv):
    cancelled = watch_counter(srv.state.metrics.cancelled)
    body = {"model": "tiny", "prompt": "another long answer", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert cancelled.wait(30), "the server did not cancel the abandoned request"
    assert on_engine(srv, lambda: len(srv.state.worker.jobs)) == 0


def test_cli_refuses_a_policy_that_needs_the_future():
    from typer.testing import CliRunner

    from pbkv.cli import app
    r = CliRunner().invoke(app, ["serve", "--policy", "oracle"])
    assert r.exit_code == 2 and "future" in r.output


def test_without_max_tokens_a_long_prompt_gets_what_the_context_leaves(srv):
    limit = srv.state.max_context
    prompt = [7] * (limit - 4)                               # token ids: 4 positions left
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4      # the default (256) capped, not a 400


def test_the_openai_client_retrieves_the_model_and_probes_may_use_head(srv, client):
    assert client.models.retrieve("tiny").id == "tiny"
    r = httpx.get(srv.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.head(srv.url + "/health").status_code == 200
    r = post(srv, "/v1/completions", {"model": "tiny", "prompt": "p", "max_tokens": 2,
                                      "stream_options": {"include_usage": True}})       # without stream: true
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    assert "only allowed when stream is true" in r.json()["error"]["message"]
    assert 'endpoint="/v1/models/{id}"' in httpx.get(srv.url + "/metrics").text


def test_a_call_cancelled_while_it_waited_for_room_adds_no_prompt_tokens(torch_threads):  # noqa: F811
    """A holds the whole device while it decodes; B cannot be admitted, and its client leaves.
    Before: B's prompt counted in pbkv_prompt_tokens_total but in no hit or recomputed counter,
    so hits + recomputed fell short of the prompt tokens and every hit rate was understated."""
    from pbkv.cache import CacheConfig
    srv = start_server(cache=CacheConfig(device_tokens=1000), max_tokens_limit=1000)
    try:
        cancelled = watch_counter(srv.state.metrics.cancelled)
        first = {"model": "tiny", "prompt": "a" * 40, "max_tokens": 940, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            holder = threading.Thread(target=c.post, args=(srv.url + "/v1/completions",), kwargs={"json": first})
            holder.start()
            assert on_engine_until(srv, lambda: srv.state.worker.engine.running_count == 1)
            with pytest.raises(httpx.ReadTimeout):   # B waits for room; its client gives up
                httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.3),
                           json={"model": "tiny", "prompt": "b" * 200, "max_tokens": 4, "temperature": 0})
            assert cancelled.wait(30)
            holder.join(120)
        m = srv.state.metrics
        hits = sum(m.hit_tokens.labels(tier=t)._value.get() for t in ("device", "host", "disk", "shared"))
        prompt = m.prompt_tokens._value.get()
        assert prompt == hits + m.recomputed_tokens._value.get() and prompt > 0
    finally:
        srv.stop()


def on_engine_until(srv, condition, seconds: float = 60) -> bool:
    """Poll `condition` on the engine thread until it holds (a deadline, no fixed sleep)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if on_engine(srv, condition):
            return True
    return False


def test_a_call_never_served_is_not_recorded_and_steps_stay_dense(torch_threads, tmp_path):  # noqa: F811
    """A holds the device; B (same workflow) waits for room and its client leaves; C ends the
    workflow. Before: B was in the --record trace (its full input_length, output 0) although it
    was never prefilled (/metrics counts none of its prompt tokens): a replay would prefill it.
    Now the trace holds A and C as steps 0 and 1."""
    from pbkv.cache import CacheConfig
    from pbkv.trace import read_trace
    srv = start_server(cache=CacheConfig(device_tokens=1000), max_tokens_limit=1000, record=str(tmp_path))
    try:
        cancelled = watch_counter(srv.state.metrics.cancelled)
        hint = {"model": "tiny", "temperature": 0, "ignore_eos": True, "workflow_id": "left"}
        first = {**hint, "prompt": "a" * 40, "max_tokens": 940, "agent": "holder"}
        with httpx.Client(timeout=120) as c:
            holder = threading.Thread(target=c.post, args=(srv.url + "/v1/completions",), kwargs={"json": first})
            holder.start()
            assert on_engine_until(srv, lambda: srv.state.worker.engine.running_count == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.3),
                           json={**hint, "prompt": "b" * 200, "max_tokens": 4, "agent": "gone"})
            assert cancelled.wait(30)
            holder.join(120)
            last = c.post(srv.url + "/v1/completions", json={**hint, "prompt": "c" * 30, "max_tokens": 2,
                                                             "agent": "last", "workflow_done": True})
            assert last.status_code == 200, last.text
        calls = [call for f in sorted(tmp_path.glob("*.jsonl")) for call in read_trace(f).calls]
        assert [(c.step, c.agent, c.input_length, c.output_length) for c in calls] == [
            (0, "holder", 40, 940), (1, "last", 30, 2)]
        assert calls[-1].done
    finally:
        srv.stop()
