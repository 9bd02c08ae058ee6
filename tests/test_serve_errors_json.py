"""Every error this server answers is the OpenAI error shape, also those that no route raises: the
connection limit's 503, graceful shutdown's timeout (503), requests uvicorn cannot parse (400),
and Starlette's own 404/405 and the body guards (400/413), checked here end to end."""

import asyncio
import json
import logging
import socket
import threading

import httpx
import pytest

from serve_helpers import start_server, torch_threads  # noqa: F401


@pytest.fixture(scope="module")
def srv(torch_threads):  # noqa: F811
    server = start_server(header_timeout=30.0)   # held connections must outlive the test, not the timeout
    yield server
    server.stop()


def completion(server, timeout=60):
    body = {"model": "tiny", "prompt": "p", "max_tokens": 4, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


def assert_openai_error(r, status, code):
    """`r` is the OpenAI error shape, sent as JSON, with `status` and `code`; its error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    return err


# ---------------------------------------------------------------- raw sockets

def _raw(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length (headers, then that many bytes)."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        assert chunk, f"the server closed after {out!r}"
        out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    assert lengths, f"no content-length in {head!r}"
    while len(body) < lengths[0]:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


# ---------------------------------------------------------------- defect 1: the connection limit

def test_the_connection_limit_answers_a_json_503_with_retry_after(srv):
    """--max-connections (3 here: two connections held, the third's request is over it): a 503 in
    the OpenAI shape with Retry-After, and the connection closed; served again once they are gone."""
    config = srv.server.config
    held = [_raw(srv) for _ in range(2)]
    config.limit_concurrency = 3      # read by each new connection
    try:
        for s in held:                # one answered request each: the server holds both connections
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _read_response(s).startswith(b"HTTP/1.1 200")
        r = httpx.get(srv.url + "/health", timeout=10)
        err = assert_openai_error(r, 503, "too_many_connections")
        assert err["type"] == "server_error"
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    finally:
        config.limit_concurrency = srv.cfg.max_connections
        for s in held:
            s.close()
    assert completion(srv).status_code == 200


def test_requests_within_the_connection_limit_are_served(srv):
    config = srv.server.config
    config.limit_concurrency = 3
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:   # one kept-alive connection
            assert [client.get("/health").status_code for _ in range(3)] == [200] * 3
    finally:
        config.limit_concurrency = srv.cfg.max_connections


@pytest.mark.parametrize("connections,others,refused", [(2, 0, False), (3, 0, True), (1, 2, False), (1, 3, True)])
def test_the_connection_limit_counts_what_uvicorn_counts(connections, others, refused):
    """Limit 3: refused with 3 connections open (its own included) or 3 other requests running
    (uvicorn's task set holds the request's own task too)."""
    from pbkv.serve.limits import ConnectionLimit
    ran, sent = [], []

    async def app(scope, receive, send):
        ran.append(scope)

    async def send(message):
        sent.append(message)

    async def request():
        tasks = {asyncio.current_task(), *(object() for _ in range(others))}
        await ConnectionLimit(app, 3, set(range(connections)), tasks)({"type": "http"}, None, send)
    asyncio.run(request())
    assert len(ran) == (0 if refused else 1)
    if refused:
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        assert json.loads(sent[1]["body"])["error"]["code"] == "too_many_connections"


# ---------------------------------------------------------------- defect 2: graceful shutdown's timeout

def _hold_engine(server) -> threading.Event:
    """Block the engine thread until the returned event is set: jobs submitted meanwhile stay
    queued (not admitted to the engine)."""
    release, held = threading.Event(), threading.Event()
    server.state.worker.call(lambda: (held.set(), release.wait(120)))
    assert held.wait(30)
    return release


def _watch_submits(server, monkeypatch) -> threading.Semaphore:
    """Released once per job the HTTP layer submits (counted in flight)."""
    worker, submitted = server.state.worker, threading.Semaphore(0)
    original = worker._count

    def count(delta):
        original(delta)
        if delta > 0:
            submitted.release()
    monkeypatch.setattr(worker, "_count", count)
    return submitted


def _in_thread(fn) -> tuple[threading.Thread, list]:
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(fn()))
    thread.start()
    return thread, answers


def test_a_request_still_queued_when_shutdown_times_out_gets_a_json_503(torch_threads, monkeypatch):  # noqa: F811
    """The engine thread is held, so the request stays queued through graceful shutdown's
    timeout: uvicorn cancels it, and the client gets a 503 `server_shutting_down` (was a
    plain-text 500). The app's shutdown (which runs after the cancel) releases the engine."""
    server = start_server()
    try:
        server.server.config.timeout_graceful_shutdown = 0.2   # read when shutdown begins
        release = _hold_engine(server)
        server.state.on_shutdown.insert(0, release.set)
        submitted = _watch_submits(server, monkeypatch)
        thread, answers = _in_thread(lambda: completion(server))
        assert submitted.acquire(timeout=30)
        server.server.should_exit = True
        thread.join(60)
    finally:
        server.stop()
    r = answers[0]
    err = assert_openai_error(r, 503, "server_shutting_down")
    assert err["type"] == "server_error" and r.headers["connection"] == "close"


def test_a_request_that_finishes_during_graceful_shutdown_gets_its_answer(torch_threads, monkeypatch):  # noqa: F811
    """Shutdown begins while the request is queued; the engine is released only then (when
    uvicorn asks its connection to close), and the request is answered as usual."""
    server = start_server()
    try:
        server.server.config.timeout_graceful_shutdown = 120   # ample: the request finishes first
        release = _hold_engine(server)
        submitted = _watch_submits(server, monkeypatch)
        thread, answers = _in_thread(lambda: completion(server))
        assert submitted.acquire(timeout=30)
        (conn,) = server.server.server_state.connections     # the request's own connection
        shutdown = conn.shutdown

        def shutdown_then_release():
            shutdown()
            release.set()
        conn.shutdown = shutdown_then_release
        server.server.should_exit = True
        thread.join(120)
    finally:
        server.stop()
    r = answers[0]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_stream_cut_by_shutdowns_timeout_ends_with_an_error_event_and_one_log_line(torch_threads):  # noqa: F811
    """A stream still running when graceful shutdown's timeout expires: its client gets an
    `error` event (server_shutting_down) and [DONE], the log one warning line. Before: the stream
    was cut without a word and uvicorn logged 'Exception in ASGI application' with a
    CancelledError traceback, per stream."""
    server = start_server(header_timeout=30.0)
    lines = _Lines()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "pbkv.serve")]
    for logger in loggers:
        logger.addHandler(lines)
    events = []
    try:
        server.server.config.timeout_graceful_shutdown = 0.2
        body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:   # streaming: hold the engine, then stop the server
                    release = _hold_engine(server)
                    server.state.on_shutdown.insert(0, release.set)
                    server.server.should_exit = True
    finally:
        server.stop()
        for logger in loggers:
            logger.removeHandler(lines)
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err == {"message": "The server is shutting down and cut this stream before it finished; retry later.",
                   "type": "server_error", "param": None, "code": "server_shutting_down"}
    messages = [rec.getMessage() for rec in lines.records]
    assert not any("Exception in ASGI application" in m for m in messages), messages
    assert not any(rec.exc_info for rec in lines.records)
    cut = [m for m in messages if m.startswith("shutdown: cut")]
    assert cut == ["shutdown: cut a streamed answer on /v1/chat/completions still running at shutdown "
                   "(graceful shutdown's timeout, or a forced quit)"]


# ---------------------------------------------------------------- requests uvicorn cannot parse

BODY_REQUEST = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",                                                   # no request line
    b"GET /\xff\xfe HTTP/1.1\r\nhost: x\r\n\r\n",                         # a target that is not ASCII
    BODY_REQUEST + b"content-length: abc\r\n\r\n",                        # a Content-Length that is no number
    BODY_REQUEST + b"transfer-encoding: chunked\r\n\r\nzz\r\n",           # a broken chunk, after the headers
], ids=["garbage", "non-ascii-target", "bad-content-length", "bad-chunk"])
def test_a_request_uvicorn_cannot_parse_gets_a_json_400(srv, request_bytes):
    s = _raw(srv)
    s.sendall(request_bytes)
    answer = _read_all(s)
    s.close()
    status, headers, body = _parse(answer)
    assert (status, headers["content-type"], headers["connection"]) == (400, "application/json", "close"), answer
    assert int(headers["content-length"]) == len(body)        # one answer only, nothing after it
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error"
    assert completion(srv).status_code == 200


# ---------------------------------------------------------------- errors the app answers itself

@pytest.mark.parametrize("method,path,content,status,code", [
    ("GET", "/no/such/route", None, 404, "not_found"),
    ("DELETE", "/v1/completions", None, 405, "method_not_allowed"),
    ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("POST", "/v1/completions", b"", 400, "invalid_json"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("POST", "/v1/completions", b"x" * (64 * 1024 + 1), 413, "request_too_large"),
    ("GET", "/v1/models/no-such-model", None, 404, "model_not_found"),
])
def test_app_errors_are_json(srv, method, path, content, status, code):
    r = httpx.request(method, srv.url + path, content=content, timeout=30)
    assert_openai_error(r, status, code)


def test_a_body_announced_too_large_is_a_json_413_before_it_arrives(srv):
    s = _raw(srv)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n")
    status, headers, body = _parse(_read_response(s))
    s.close()
    assert (status, headers["content-type"]) == (413, "application/json")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_an_error_after_the_answer_started_is_raised_on_not_swallowed():
    """`Unhandled` caught it and returned with the answer incomplete: uvicorn then logged a second
    error ("ASGI callable returned without completing response"). Now it goes on to uvicorn,
    which logs it once and closes the connection."""
    import asyncio

    from pbkv.serve.app import Unhandled

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        raise RuntimeError("boom mid-stream")

    async def send(message):
        pass

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    with pytest.raises(RuntimeError, match="boom mid-stream"):
        asyncio.run(Unhandled(app)({"type": "http", "path": "/v1/chat/completions"}, receive, send))
