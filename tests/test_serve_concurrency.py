"""64 concurrent clients on the real server: every answer arrives, none is lost or mixed up, and
each greedy answer equals the one the same prompt got when it ran alone. A request's prompt is
built off the event loop, so a large body does not stall the other clients."""

import asyncio
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from pbkv.serve import auth, schemas
from serve_helpers import on_engine, start_server, torch_threads  # noqa: F401

CLIENTS = 64


@pytest.fixture(scope="module")
def srv(torch_threads):  # noqa: F811
    server = start_server(policy="pbkv")
    yield server
    server.stop()


def prompt(i: int) -> str:
    """Random letters, seeded per client: the random model's answers then differ between clients."""
    rng = random.Random(i)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(24))


async def one(client: openai.AsyncOpenAI, i: int, stream: bool) -> tuple[int, str, str]:
    kwargs = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "agent": f"a{i % 4}"})
    if i % 2:  # half use chat, half plain completions
        messages = [{"role": "user", "content": prompt(i)}]
        if stream:
            chunks = [c async for c in await client.chat.completions.create(messages=messages, stream=True, **kwargs)]
            return i, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].id
        r = await client.chat.completions.create(messages=messages, **kwargs)
        return i, r.choices[0].message.content, r.id
    if stream:
        chunks = [c async for c in await client.completions.create(prompt=prompt(i), stream=True, **kwargs)]
        return i, "".join(c.choices[0].text for c in chunks), chunks[-1].id
    r = await client.completions.create(prompt=prompt(i), **kwargs)
    return i, r.choices[0].text, r.id


def test_64_concurrent_clients_get_their_own_answers(srv):
    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        alone = {}
        for i in range(CLIENTS):  # each prompt alone first: the reference answer
            alone[i] = (await one(client, i, stream=False))[1]
        together = await asyncio.gather(*(one(client, i, stream=i % 4 < 2) for i in range(CLIENTS)))
        await client.close()
        return alone, together
    alone, together = asyncio.run(main())
    assert sorted(i for i, _, _ in together) == list(range(CLIENTS))           # none lost
    assert len({rid for _, _, rid in together}) == CLIENTS                       # each its own response
    assert len(set(alone.values())) > CLIENTS // 2                              # answers tell prompts apart
    mismatched = [i for i, text, _ in together if text != alone[i]]
    assert mismatched == [], f"answers differ from the lone run for clients {mismatched}"
    worker = srv.state.worker
    jobs, running, queued = on_engine(srv, lambda: (len(worker.jobs), worker.engine.running_count,
                                                    worker.engine.queue_depth))
    assert (jobs, running, queued, srv.state.worker.in_flight) == (0, 0, 0, 0)
    assert srv.state.worker.peak_running > 8   # they really ran side by side (one decode batch)


@pytest.mark.parametrize("path, schema, tokenize, body", [
    ("/v1/chat/completions", schemas.ChatRequest, "chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", schemas.CompletionRequest, "encode", {"prompt": "hi"}),
])
def test_a_prompt_is_built_off_the_event_loop(srv, monkeypatch, path, schema, tokenize, body):
    """JSON parsing, validation, rendering and tokenizing take time the client picks (~0.3 s for
    a 1 MB body of short messages); on the event loop they stalled every other client's stream
    and /health. Now they run on a worker thread: while one prompt is being built, /health answers."""
    threads, building, release = {}, threading.Event(), threading.Event()

    def seen(step, fn, block=False):
        def wrapped(*args, **kwargs):
            threads[step] = threading.current_thread()
            if block:
                building.set()
                release.wait(60)
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(auth, "json", SimpleNamespace(loads=seen("json", json.loads)))
    monkeypatch.setattr(schema, "model_validate", seen("validate", schema.model_validate))
    monkeypatch.setattr(srv.state.tokenizer, tokenize, seen("tokenize", getattr(srv.state.tokenizer, tokenize), True))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, srv.url + path, json={"model": "tiny", "max_tokens": 2} | body, timeout=60)
        try:
            assert building.wait(60)
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200   # the loop is free meanwhile
        finally:
            release.set()
        assert answer.result().status_code == 200
    assert set(threads) == {"json", "validate", "tokenize"}
    assert srv._thread not in threads.values()   # the event loop's thread (uvicorn's)
