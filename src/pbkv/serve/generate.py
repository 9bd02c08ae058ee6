"""One completion request, from a validated body to a JSON answer or a server-sent-event stream.

Both endpoints (chat and plain completions) go the same way: the prompt ids come from a worker
thread (`app.chat_prompt` / `app.completion_prompt`: their cost grows with the body), then, on
the event loop, check sizes, submit a `Job` to the engine thread, read that job's events. A client that
goes away (a stream's send fails or its task is cancelled; a plain request's connection reports
disconnect) cancels the job: the engine stops it at the next step and frees its KV space.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pbkv.engine.sampling import Sampling
from pbkv.serve import schemas
from pbkv.serve.errors import APIError, bad_request, model_not_found, overloaded
from pbkv.serve.jobs import ERROR, Done, Job
from pbkv.serve.workflows import Hints

CONTEXT_CHARS = 500      # the latest message, as the predictor's `context` text
CLIENT_GONE = 499        # status of an answer nobody waits for any more (nginx's convention)
REPLICA_FAILED = "replica_failed"   # `Done.code` of a call lost with its engine replica (pbkv.scale): 503
REPLICAS_UNAVAILABLE = "replicas_unavailable"   # `Done.code` of a call no engine replica could take: 503
# Retry-After per 503 code: a lost call's retry goes to another replica at once; with no replica
# running, Ray restarts them in tens of seconds, so clients retry a few times meanwhile
RETRY_AFTER_S = {REPLICA_FAILED: 1, REPLICAS_UNAVAILABLE: 5}


@dataclass
class Prepared:
    job: Job
    chat: bool
    stream: bool = False
    stream_usage: bool = False
    echo: str = ""


def prepare(state, body: schemas._Common, prompt_ids: list[int], context: str | None, chat: bool,
            hints: Hints) -> Prepared:
    """Checks shared by both endpoints; raises `APIError` (4xx) for every client mistake."""
    if body.model != state.model_name:
        raise model_not_found(body.model, state.model_name)
    param = "messages" if chat else "prompt"
    if not prompt_ids:
        raise bad_request("The prompt is empty.", param, "invalid_value")
    wanted = body.wanted_tokens()
    limits = state.config
    limit = state.max_context
    if wanted is None:   # the default fits what the prompt leaves of the context (as vLLM's does)
        max_tokens = max(1, min(limits.default_max_tokens, limits.max_tokens_limit, limit - len(prompt_ids)))
    else:
        max_tokens = wanted
    if max_tokens > limits.max_tokens_limit:
        field = body.tokens_param()   # the field the client sent (max_tokens or max_completion_tokens)
        raise bad_request(f"{field} is {max_tokens}; this server allows at most {limits.max_tokens_limit}.",
                          field, "invalid_value")
    if len(prompt_ids) + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} "
                          f"for the completion). Please reduce the prompt or {body.tokens_param()}.", param,
                          "context_length_exceeded")
    if state.worker.in_flight >= limits.max_queue:
        raise overloaded(state.worker.in_flight)
    state.worker.check_ready()   # the replicas' worker raises 503 while no replica runs
    sampling = Sampling(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                        ignore_eos=body.ignore_eos)   # EOS ids: the engine's (the tokenizer's)
    job = Job(list(prompt_ids), sampling, hints, body.stops(), context[-CONTEXT_CHARS:] if context else None,
              streamed=body.stream)
    return Prepared(job, chat, body.stream, body.include_usage())


async def _events(job: Job, request: Request):
    """The job's events as they come; raises `ConnectionError` as soon as the client disconnects.

    The body was read in full, so the next ASGI `receive()` resolves only when the client goes
    away (Starlette listens the same way during streams): no polling."""
    gone = asyncio.ensure_future(request.receive())
    try:
        while True:
            get = asyncio.ensure_future(job.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ConnectionError("client disconnected")
            yield get.result()
            while not job.events.empty():  # a burst of tokens: no task per event
                yield job.events.get_nowait()
    finally:
        gone.cancel()


async def respond(state, request: Request, p: Prepared):
    worker = state.worker
    start = time.perf_counter()
    job = worker.submit(p.job)
    rid = schemas.new_id("chatcmpl" if p.chat else "cmpl")
    if p.stream:
        return StreamingResponse(_stream(state, p, rid, start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    parts, done, first = [], None, None
    try:
        async with aclosing(_events(job, request)) as events:
            async for event in events:
                if isinstance(event, Done):
                    done = event
                    break
                # a piece the replicas' ingress held: when it came (HeldText), not when handed on
                first = first or getattr(event, "arrived", None) or time.perf_counter()
                parts.append(event)
    except ConnectionError:
        return Response(status_code=CLIENT_GONE)  # nobody reads it; counted in /metrics as 499
    finally:
        if done is None:  # the client went away: stop generating for nobody
            worker.cancel(job)
    if done.reason == ERROR:
        after = RETRY_AFTER_S.get(done.code)
        retry = None if after is None else {"Retry-After": str(after)}
        raise APIError(503 if retry else 500, f"The server failed while generating: {done.error}", "server_error",
                       None, done.code, headers=retry)
    _observe(state, start, first)
    text = p.echo + "".join(parts)
    build = schemas.chat_response if p.chat else schemas.completion_response
    return JSONResponse(build(rid, state.model_name, text, _finish(done.reason), done.prompt_tokens,
                              done.completion_tokens, done.cached))


def _finish(reason: str) -> str:
    return "stop" if reason == "stop" else "length"


def _observe(state, start: float, first: float | None) -> None:
    now = time.perf_counter()
    state.metrics.latency.observe(now - start)
    state.metrics.first_token.observe((first or now) - start)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(state, p: Prepared, rid: str, start: float) -> AsyncIterator[str]:
    model, created = state.model_name, int(time.time())
    done, first = None, None

    def chunk(obj: dict) -> str:
        if p.stream_usage:   # as OpenAI: with include_usage, every chunk before the usage one has "usage": null
            obj["usage"] = None
        return _sse(obj)
    try:
        if p.chat:
            yield chunk(schemas.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        elif p.echo:
            yield chunk(schemas.completion_chunk(rid, model, created, p.echo))
        while done is None:
            event = await p.job.events.get()
            if isinstance(event, Done):
                done = event
            elif p.chat:
                first = first or time.perf_counter()
                yield chunk(schemas.chat_chunk(rid, model, created, {"content": event}))
            else:
                first = first or time.perf_counter()
                yield chunk(schemas.completion_chunk(rid, model, created, event))
        if done.reason == ERROR:
            yield _sse({"error": {"message": f"The server failed while generating: {done.error}",
                                  "type": "server_error", "param": None, "code": done.code}})
        else:
            _observe(state, start, first)
            if p.chat:
                yield chunk(schemas.chat_chunk(rid, model, created, {}, _finish(done.reason)))
            else:
                yield chunk(schemas.completion_chunk(rid, model, created, "", _finish(done.reason)))
            if p.stream_usage:
                obj = "chat.completion.chunk" if p.chat else "text_completion"
                yield _sse(schemas.usage_chunk(rid, model, created, obj, done.prompt_tokens,
                                               done.completion_tokens, done.cached))
        yield "data: [DONE]\n\n"
    finally:
        if done is None:  # the client went away (send failed or the task was cancelled)
            state.worker.cancel(p.job)
