"""The FastAPI application: routes, error shapes, request counting.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, POST /v1/workflows/{id}/end. Every route but /health needs the API key when one is
set. Every error (ours, Starlette's 404/405, an unexpected exception, a request cut off by
graceful shutdown's timeout) leaves as the OpenAI error shape (`errors.py`); the app never lets
one request's failure stop the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from fastapi import FastAPI
from pydantic import ValidationError
from anyio import CapacityLimiter, to_thread
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pbkv.serve import schemas
from pbkv.serve.auth import check_api_key, header_hint, parse_json, read_body
from pbkv.serve.errors import (INVALID, APIError, bad_request, error_body, model_not_found, pydantic_errors,
                               send_error, shutting_down, stream_cut)
from pbkv.serve.gauges import engine_snapshot
from pbkv.serve.limits import BodyTimeout
from pbkv.serve.generate import CLIENT_GONE, prepare, respond
from pbkv.serve.metrics import CONTENT_TYPE, Metrics
from pbkv.serve.tokenizer import ChatRefused, Tokenizer
from pbkv.serve.worker import EngineWorker
from pbkv.serve.workflows import Hints

if TYPE_CHECKING:  # server.py builds the state and imports this module
    from pbkv.serve.server import ServeConfig

log = logging.getLogger("pbkv.serve")
ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
LABELS = (("/v1/workflows/", "/v1/workflows/{id}/end"), ("/v1/models/", "/v1/models/{id}"))  # bounded labels


@dataclass
class ServerState:
    """Everything the routes read; built by `server.build_state`."""

    model_name: str
    policy_name: str
    tokenizer: Tokenizer
    worker: EngineWorker
    metrics: Metrics
    max_context: int
    config: ServeConfig                   # the limits: api_key, max_body_bytes, max_tokens_limit, ...
    created: int = field(default_factory=lambda: int(time.time()))
    setup: object = None                  # learning.PolicySetup (policy, learner, model dir)
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)
    # set by an ingress in front of engine replicas (pbkv.scale.serve_app); None: the local engine
    exposition: Callable[[], Awaitable[bytes]] | None = None   # the /metrics text
    health: Callable[[], dict] | None = None                   # more /health fields

    def shut_down(self) -> None:
        """Run the `on_shutdown` steps in order, each at most once (taken off the list as it
        runs): the lifespan's end runs them, and `server.run_server` after uvicorn returns runs
        those a forced quit skipped. A failing step is logged and the next still runs."""
        while self.on_shutdown:
            fn = self.on_shutdown.pop(0)
            try:
                fn()
            except Exception:  # noqa: BLE001 - run every shutdown step, report each failure
                log.exception("shutdown step failed")


class CountRequests:
    """Pure ASGI middleware (streams pass through untouched): counts answers by route and status.
    Paths outside the known routes share one label, so clients cannot grow the label set."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            if path not in ROUTES:
                path = next((label for prefix, label in LABELS if path.startswith(prefix)), "other")
            self.metrics.requests.labels(endpoint=path, status=str(status[0])).inc()


class Unhandled:
    """Pure ASGI middleware: an unexpected error (a server bug, e.g. a chat template broken on the
    server's side) is logged once with its traceback and answered 500 `internal_error` (OpenAI
    shape), and ends here. Left to Starlette's exception handler it was logged twice: by the
    handler, and by uvicorn ("Exception in ASGI application"), which Starlette re-raises it to. An
    error after the answer started is raised on (no 500 can follow a started answer): uvicorn
    logs it once and closes the connection, so the client sees the answer cut, not completed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_started(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:  # noqa: BLE001 - every unexpected error: one log line, one 500
            if started:   # too late for a 500: uvicorn logs it (once) and closes the connection
                raise
            log.exception("unhandled error on %s", scope.get("path", ""))
            await _internal_error(exc)(scope, receive, send)


def _internal_error(exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"Internal server error ({type(exc).__name__}).", "server_error", None,
                                   "internal_error"), status_code=500)


class AnswerCancelled:
    """Pure ASGI middleware: a request cancelled before its answer started gets a 503
    `server_shutting_down` (OpenAI shape), not uvicorn's plain-text 500.

    A request's task is cancelled only when graceful shutdown's timeout expires or at a forced
    quit (asyncio.run's teardown) (a client that
    leaves is seen through `receive()`, never by cancellation), and the route's own cleanup has
    run by then (its job is cancelled on the engine). An answer already started cannot be
    replaced: a stream (text/event-stream) gets a last `error` event (`server_shutting_down`) and
    `[DONE]`, so its client knows it was cut; either way one line is logged, and the cancellation
    ends here (re-raised, uvicorn would log a traceback per request for an ordinary stop)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, stream = False, False

        async def send_started(message):
            nonlocal started, stream
            if message["type"] == "http.response.start":
                started = True
                stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            await send(message)
        try:
            await self.app(scope, receive, send_started)
        except asyncio.CancelledError:
            # not re-raised: this is the request task's last step, nothing after it needs to see
            # the cancellation, and uvicorn would answer a cancelled task with a plain-text 500
            # (or, once the answer started, log it with a traceback)
            if not started:
                await send_error(send, shutting_down())
                return
            log.warning("shutdown: cut %s answer on %s still running at shutdown (graceful shutdown's "
                        "timeout, or a forced quit)", "a streamed" if stream else "an", scope.get("path", ""))
            if stream:
                await _end_stream(send)


async def _end_stream(send) -> None:
    """Close a cut stream with an `error` event and `[DONE]` (best effort: the client may be gone)."""
    body = f"data: {json.dumps(stream_cut().body(), separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
    try:   # no task of its own (asyncio.run's teardown may cancel this one again: then it just ends)
        async with asyncio.timeout(1.0):
            await send({"type": "http.response.body", "body": body, "more_body": False})
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - a client that cannot be written to hears nothing
        pass


def _hints(request: Request, body: schemas._Common) -> Hints:
    """The call's workflow hints: body fields first, then the headers `X-Workflow-Id`, `X-Agent`."""
    workflow_id, agent = header_hint(request, "x-workflow-id"), header_hint(request, "x-agent")  # both checked
    return Hints(body.workflow_id or workflow_id, body.agent or agent, body.workflow_done)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        except asyncio.CancelledError:
            # uvicorn's force quit (a second Ctrl-C) skips the lifespan's shutdown, and asyncio.run's
            # teardown cancels this task: `server.run_server` runs the steps once uvicorn returned.
            # Not re-raised: Starlette would log it as a failed shutdown, with a traceback
            return
        state.shut_down()

    app = FastAPI(title="pbkv serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.pbkv = state
    app.add_middleware(BodyTimeout, seconds=state.config.body_timeout)
    app.add_middleware(Unhandled)
    app.add_middleware(AnswerCancelled)   # outside BodyTimeout: a request still sending its body is answered too
    app.add_middleware(CountRequests, metrics=state.metrics)   # added last: outermost, counts the 408s and 503s too
    _error_handlers(app)
    _info_routes(app, state)
    _completion_routes(app, state)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error leaves in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, INVALID, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        # the client left before its body was read (or sent a broken one): nothing to answer,
        # nothing went wrong here; counted as 499 like a client gone mid-generation
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)   # one `Unhandled` did not catch
        return _internal_error(exc)


def _info_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /v1/models, /metrics, /v1/workflows/{workflow_id}/end."""

    @app.api_route("/health", methods=["GET", "HEAD"])   # HEAD: load balancers' probes
    async def health():
        extra = state.health() if state.health is not None else {}
        return {"status": "ok", "model": state.model_name, "policy": state.policy_name} | extra

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, state.config.api_key)
        return schemas.models_response(state.model_name, state.created)

    @app.get("/v1/models/{model:path}")   # the OpenAI client's models.retrieve
    async def model(request: Request, model: str):
        check_api_key(request, state.config.api_key)
        if model != state.model_name:
            raise model_not_found(model, state.model_name)
        return schemas.model_object(state.model_name, state.created)

    @app.get("/metrics")
    async def metrics(request: Request):
        check_api_key(request, state.config.api_key)
        text = await (state.exposition or local_exposition(state))()
        return Response(text, media_type=CONTENT_TYPE)

    @app.post("/v1/workflows/{workflow_id:path}/end")  # an id may hold "/"
    async def end_workflow(request: Request, workflow_id: str):
        check_api_key(request, state.config.api_key)
        if not 0 < len(workflow_id) <= schemas.MAX_HINT_CHARS:
            raise bad_request(f"A workflow id has 1 to {schemas.MAX_HINT_CHARS} characters.", "workflow_id", "invalid_value")
        found = await asyncio.wrap_future(state.worker.end_workflow(workflow_id))
        if not found:
            raise APIError(404, f"No running workflow {workflow_id!r} (never started, or already ended).",
                           INVALID, "workflow_id", "workflow_not_found")
        return {"id": workflow_id, "object": "workflow", "ended": True}


def local_exposition(state: ServerState) -> Callable[[], Awaitable[bytes]]:
    """/metrics of a server whose engine runs in this process: its counters, then the engine's
    figures taken on the engine thread."""
    async def exposition() -> bytes:
        worker = state.worker
        snapshot = await asyncio.wrap_future(worker.call(lambda: engine_snapshot(
            worker.engine, worker.in_flight, len(worker.table.live), state.metrics.hit_rates())))
        return state.metrics.exposition(snapshot)
    return exposition


def _completion_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/chat/completions and /v1/completions. The event loop reads the body; turning it
    into prompt ids (JSON, the schema, rendering, tokenizing: ~0.3 s for a 1 MB body of short
    messages) runs on a worker thread, so a large body stalls the other clients' streams and
    /health far less (its long single calls still hold the GIL: README, "Large bodies"). The
    checks, their order and their errors are the same either way."""

    # one prompt built at a time: under the GIL more threads would not build faster, they would
    # only take more of it from the event loop and the engine thread (measured with ten 1 MB
    # bodies at once: /health answered within 0.2 s with one thread, up to 0.5 s with two, 2.9 s with 40)
    lane = CapacityLimiter(1)

    async def off_loop(build, raw: bytes):
        return await to_thread.run_sync(build, state, raw, limiter=lane)

    async def _body(request: Request) -> bytes:
        """Auth, then the body within the size limit: each failure is an OpenAI-style 4xx."""
        check_api_key(request, state.config.api_key)
        return await read_body(request, state.config.max_body_bytes)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, prompt_ids, context = await off_loop(chat_prompt, await _body(request))
        p = prepare(state, body, prompt_ids, context, True, _hints(request, body))
        return await respond(state, request, p)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, prompt_ids, text = await off_loop(completion_prompt, await _body(request))
        p = prepare(state, body, prompt_ids, text, False, _hints(request, body))
        if body.echo:
            p.echo = text
        return await respond(state, request, p)


def validated(raw: bytes, schema):
    """JSON, then the schema: each failure is an OpenAI-style 400."""
    data = parse_json(raw)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise pydantic_errors(e) from None


def chat_prompt(state: ServerState, raw: bytes) -> tuple[schemas.ChatRequest, list[int], str]:
    """A chat body's request, prompt ids and latest message; raises `APIError` (4xx)."""
    body = validated(raw, schemas.ChatRequest)
    if body.model != state.model_name:   # before rendering: a wrong model is a 404 whatever the chat
        raise model_not_found(body.model, state.model_name)
    # every field that tells the messages apart reaches the prompt (name, tool calls, tool_call_id),
    # and so do the function definitions (tools / functions): else distinct chats would share KV
    messages = [m.prompt_dict() for m in body.messages]
    try:
        prompt_ids = state.tokenizer.chat(messages, body.prompt_tools())
    except ChatRefused as e:   # the client's chat does not fit the model's template
        raise bad_request(str(e), "messages", "chat_template_refused") from None
    return body, prompt_ids, messages[-1]["content"]


def completion_prompt(state: ServerState, raw: bytes) -> tuple[schemas.CompletionRequest, list[int], str]:
    """A completion body's request, prompt ids and prompt text; raises `APIError` (4xx)."""
    body = validated(raw, schemas.CompletionRequest)
    tokenizer = state.tokenizer
    if isinstance(body.prompt, str):
        return body, tokenizer.encode(body.prompt), body.prompt
    bad = [t for t in body.prompt if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(f"Token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size}).",
                          "prompt", "invalid_value")
    return body, body.prompt, tokenizer.decode(body.prompt)
