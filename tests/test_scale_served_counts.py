"""/metrics of `pbkv serve --replicas N`, without Ray: the served-token totals (prompt,
completion, hits per tier, recomputed) are counted by the ingress from every answer's usage, so a
replica that dies before any scrape loses none of them; the per-replica samples stay the
replicas' own."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pbkv.scale import adapter  # noqa: E402
from pbkv.scale.ingress import ingress_state  # noqa: E402
from pbkv.scale.metrics_merge import SERVED, Merger  # noqa: E402
from pbkv.serve import ServeConfig  # noqa: E402
from pbkv.serve.app import create_app  # noqa: E402
from pbkv.serve.jobs import Done  # noqa: E402
from pbkv.serve.metrics import Metrics, parse  # noqa: E402
from test_scale_unavailable import Handle as UnavailableHandle, Router  # noqa: E402

ANSWER = Done("stop", 40, 5, {"device": 16, "shared": 16})


class Answers:
    """A replica's streamed answer: its id, the text, then `ANSWER`."""

    def __init__(self):
        self.events = [{"replica": "a"}, "hello", ANSWER]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        pass


class Handle(UnavailableHandle):
    """A deployment whose replica answers every call, then dies before any /metrics scrape (a
    broadcast reaches nobody)."""
    app_name = "served-app"

    def remote(self, route, job):
        return Answers()


def test_served_tokens_of_a_replica_dead_before_any_scrape_are_in_the_totals():
    router = Router(1)
    router.app_name = Handle.app_name
    adapter.register_router(router)
    state = ingress_state(ServeConfig(model="tiny"), Handle(), 1)

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")
        async with http:
            for _ in range(3):
                answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5})
                assert answer.json()["usage"]["completion_tokens"] == 5
            return parse((await http.get("/metrics")).text)
    got = asyncio.run(main())
    assert got["pbkv_replicas"] == 0                              # the replica is gone, never scraped
    assert got["pbkv_prompt_tokens_total"] == 120 and got["pbkv_completion_tokens_total"] == 15
    assert got['pbkv_cache_hit_tokens_total{tier="device"}'] == 48
    assert got['pbkv_cache_hit_tokens_total{tier="shared"}'] == 48
    assert got["pbkv_cache_recomputed_tokens_total"] == 24


def test_with_own_totals_the_ingress_counts_are_the_totals_and_the_replicas_keep_their_samples():
    own, replica = Metrics(), Metrics()
    own.served(100, 10, {"device": 60}, 40, cancelled=False)
    replica.served(70, 7, {"device": 30}, 40, cancelled=False)     # it answered 70 of them before the scrape
    replica.workflows_started.inc(3)
    got = parse(Merger(own_totals=SERVED).merge(own.exposition().decode(),
                                                {"a": replica.exposition().decode()}).decode())
    assert got["pbkv_prompt_tokens_total"] == 100 and got['pbkv_prompt_tokens_total{replica="a"}'] == 70
    assert got['pbkv_cache_hit_tokens_total{tier="device"}'] == 60
    assert got["pbkv_workflows_started_total"] == 3               # not counted by the ingress: the replica's
    plain = parse(Merger().merge(own.exposition().decode(), {"a": replica.exposition().decode()}).decode())
    assert plain["pbkv_prompt_tokens_total"] == 70                # without own totals: the replicas' sum
