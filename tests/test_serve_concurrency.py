"""64 concurrent clients on the real server: every answer arrives, none is lost or mixed up, and
each greedy answer equals the one the same prompt got when it ran alone."""

import asyncio
import random

import openai
import pytest

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
