"""`pbkv serve --replicas 2` for real: a local Ray, two `tiny` engine replicas behind pbkv's router,
the ingress on a free loopback port, driven by HTTP clients (openai, httpx); answers compared with
a single-process `ServerThread` of the same model and seed (greedy: the same text).

Marked `ray`; ONE Ray session for the module (Ray + 2 replicas take ~40-60 s on a busy 2-core
machine) and two apps in it: the main one (router pbkv), and a second one (`shared`, 2 more
replicas reserving no Ray CPUs, router round-robin) whose replicas share one KV directory. Skipped without Ray (`pip install 'pbkv[scale]'`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from pbkv.cache import CacheConfig  # noqa: E402
from pbkv.serve import ServeConfig, ServerThread  # noqa: E402
from pbkv.serve.metrics import parse  # noqa: E402

pytestmark = pytest.mark.ray
SRC = str(Path(__file__).resolve().parent.parent / "src")
KEY = "sk-test-replicas"
AUTH = {"Authorization": f"Bearer {KEY}"}
CFG = ServeConfig(model="tiny", port=0, threads=1, cache=CacheConfig(device_tokens=8192), api_key=KEY,
                  max_tokens_limit=1024, default_max_tokens=8, idle_timeout=60.0)


@pytest.fixture(scope="module")
def servers():
    from pbkv.scale.serve_app import ReplicaOptions, ReplicaServer
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])  # replicas import this pbkv
    single = ServerThread(CFG).start()
    temp = tempfile.mkdtemp(prefix="pbkvray")
    scaled = ReplicaServer(CFG, ReplicaOptions(replicas=2, router="pbkv", stats_period_s=0.5),
                           log_to_driver=False, _temp_dir=temp).start()
    yield single, scaled
    scaled.stop()
    single.stop()


@pytest.fixture(scope="module")
def shared(servers, tmp_path_factory):
    """The second app, in the same Ray session (so torn down before it): 2 replicas sharing a KV
    directory behind the round-robin router, which sends consecutive calls to alternate replicas."""
    from pbkv.scale.serve_app import ReplicaOptions, ReplicaServer
    cache = dataclasses.replace(CFG.cache, shared_dir=str(tmp_path_factory.mktemp("kv")), shared_bytes=64 << 20)
    opts = ReplicaOptions(replicas=2, router="round-robin", app_name="pbkv-shared", stats_period_s=0.5,
                          replica_cpus=0)   # the main app's replicas hold the session's CPUs
    srv = ReplicaServer(dataclasses.replace(CFG, cache=cache), opts).start()
    yield srv
    srv.stop()


def _metrics(url: str) -> dict[str, float]:
    return parse(httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text)


def _per_replica(metrics: dict, name: str) -> dict[str, float]:
    """{replica id: value} of an unlabelled family's per-replica samples."""
    return {k.split('replica="')[1].split('"')[0]: v for k, v in metrics.items() if k.startswith(name + "{replica=")}


def _chat(url: str, messages, **extra):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **extra)


def test_a_workflows_calls_stay_on_one_replica_and_match_one_process(servers):
    single, scaled = servers
    before = _metrics(scaled.url)
    cached = []
    for w in range(4):
        messages = []   # no shared system prompt: a shared first block would rightly draw pbkv's router to one replica
        for step in range(3):
            messages.append({"role": "user", "content": f"W{w} step {step}: plan, code, test"})
            hints = {"extra_body": {"workflow_id": f"wf-{w}", "agent": f"agent-{step}"}}
            got, want = _chat(scaled.url, messages, **hints), _chat(single.url, messages, **hints)
            assert got.choices[0].message.content == want.choices[0].message.content
            assert got.usage.prompt_tokens == want.usage.prompt_tokens
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": got.choices[0].message.content})
    after = _metrics(scaled.url)
    started = {r: after[f'pbkv_workflows_started_total{{replica="{r}"}}'] - v
               for r, v in _per_replica(before, "pbkv_workflows_started_total").items()}
    assert sum(started.values()) == 4, started        # each workflow started on one replica only
    assert all(v > 0 for v in started.values()), started   # and the four spread over both
    assert all(c > 0 for i, c in enumerate(cached) if i % 3), cached   # later steps reuse their prefix


def test_streaming_gives_the_same_text_and_usage(servers):
    single, scaled = servers
    messages = [{"role": "user", "content": "stream me something"}]
    want = _chat(single.url, messages).choices[0].message.content
    stream = _chat(scaled.url, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 8
    body = {"model": "tiny", "prompt": "plain stream", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{scaled.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
    one = httpx.post(f"{single.url}/v1/completions", json=body | {"stream": False}, headers=AUTH, timeout=60)
    assert text == one.json()["choices"][0]["text"]


def test_the_api_key_limits_errors_and_workflow_end_behave_as_one_process(servers):
    _, scaled = servers
    url = scaled.url
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": "tiny", "policy": "pbkv", "replicas": 2}
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    bad = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    big = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5000}, headers=AUTH)
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens"
    body = {"model": "tiny", "prompt": "end me", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH | {"X-Workflow-Id": "to-end"}).status_code == 200
    ended = httpx.post(f"{url}/v1/workflows/to-end/end", headers=AUTH)
    assert ended.json() == {"id": "to-end", "object": "workflow", "ended": True}
    again = httpx.post(f"{url}/v1/workflows/to-end/end", headers=AUTH)
    assert again.status_code == 404 and again.json()["error"]["code"] == "workflow_not_found"


def test_metrics_are_summed_and_per_replica(servers):
    _, scaled = servers
    m = _metrics(scaled.url)
    assert m["pbkv_replicas"] == 2
    for name in ("pbkv_prompt_tokens_total", "pbkv_completion_tokens_total", "pbkv_workflows_started_total",
                 "pbkv_cache_recomputed_tokens_total", "pbkv_in_flight_requests"):
        per = _per_replica(m, name)
        assert len(per) == 2 and m[name] == sum(per.values()), (name, per)
    assert m['pbkv_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 12
    assert m["pbkv_replica_failed_requests_total"] == 0 and m["pbkv_replica_retried_requests_total"] == 0


async def _client(http, i: int, expected: dict, got: dict) -> None:
    for step in range(2):
        prompt = f"client {i} says {i * 7919 % 1000} at step {step}"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
                "workflow_id": f"c{i}"}
        r = await http.post("/v1/completions", json=body)
        got[(i, step)] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        expected.setdefault((i, step), prompt)


def test_64_concurrent_clients_lose_and_mix_up_nothing(servers):
    single, scaled = servers
    got, prompts = {}, {}

    async def main():
        async with httpx.AsyncClient(base_url=scaled.url, headers=AUTH, timeout=180,
                                     limits=httpx.Limits(max_connections=64)) as http:
            await asyncio.gather(*(_client(http, i, prompts, got) for i in range(64)))
    asyncio.run(main())
    assert len(got) == 128
    with httpx.Client(base_url=single.url, headers=AUTH, timeout=60) as one:
        for key, prompt in prompts.items():
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True}
            assert got[key] == one.post("/v1/completions", json=body).json()["choices"][0]["text"], key


async def _plain(http, i: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": f"long plain {i}", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    r = await http.post("/v1/completions", json=body)
    out[("plain", i)] = (r.status_code, r.json())


async def _streamed(http, i: int, out: dict, first_text: asyncio.Event) -> None:
    body = {"model": "tiny", "prompt": f"long stream {i}", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, error = [], None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text.append(event["choices"][0]["text"])
                first_text.set()
    out[("stream", i)] = ("".join(text), error)


LONG = 400   # tokens per call: long enough that every call is still running when the replica is killed


def _actor(replica: str):
    """The Ray actor of engine replica `replica`."""
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].endswith(f"#{replica}") and "PBKVEngine" in a["name"]]
    assert len(actors) == 1, actors
    return ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])


def _kill(url: str, replica: str) -> None:
    ray.kill(_actor(replica), no_restart=True)


async def _load_a_replica(http, n: int, out: dict, seen: dict) -> list:
    """Start `n` plain and `n` streamed long calls; once every one has reached a replica, put the
    replica holding most of them in `seen["victim"]` and their count in `seen["in_flight"]`.
    The calls' futures (their results land in `out`)."""
    started = [asyncio.Event() for _ in range(n)]
    calls = [asyncio.ensure_future(_plain(http, i, out)) for i in range(n)]
    calls += [asyncio.ensure_future(_streamed(http, i, out, started[i])) for i in range(n)]
    await asyncio.gather(*(e.wait() for e in started))
    while True:   # every call has reached a replica (the ingress's and the replicas' counts agree)
        m = parse((await http.get("/metrics")).text)
        if m["pbkv_in_flight_requests"] == 2 * n:
            break
    per = _per_replica(m, "pbkv_in_flight_requests")
    seen["victim"] = victim = max(sorted(per), key=per.get)
    seen["in_flight"] = per[victim]
    return calls


def _check_failover(single, before: dict, after: dict, out: dict, seen: dict) -> tuple[float, float]:
    """The calls the victim held were retried or failed, nothing else; only streams already
    sending text failed (replica_failed); every other call got the one-process answer. (failed,
    retried)."""
    failed = after["pbkv_replica_failed_requests_total"] - before["pbkv_replica_failed_requests_total"]
    retried = after["pbkv_replica_retried_requests_total"] - before["pbkv_replica_retried_requests_total"]
    assert seen["in_flight"] >= 1 and failed + retried == seen["in_flight"], (failed, retried, seen)
    broken = [k for k, (text, error) in out.items() if k[0] == "stream" and error is not None]
    assert len(broken) == failed, out             # only streams already sending text are lost...
    assert all(out[k][1]["code"] == "replica_failed" for k in broken)
    want = asyncio.run(_one_process(single.url, [f"long {kind} {i}" for kind, i in out]))
    for ((kind, i), value), text in zip(out.items(), want):   # ...every other call got its whole, right answer
        if kind == "plain":
            assert value[0] == 200 and value[1]["choices"][0]["text"] == text, i
        elif value[1] is None:
            assert value[0] == text, i
    return failed, retried


def test_a_replica_killed_mid_run_loses_only_its_streams_already_sending(servers):
    single, scaled = servers
    before = _metrics(scaled.url)
    out, seen = {}, {}

    async def main():
        async with httpx.AsyncClient(base_url=scaled.url, headers=AUTH, timeout=300) as http:
            calls = await _load_a_replica(http, 4, out, seen)
            _kill(scaled.url, seen["victim"])
            await asyncio.gather(*calls)
            seen["after"] = (await http.post("/v1/completions", json={"model": "tiny", "prompt": "still there?",
                                                                      "max_tokens": 3})).status_code
    asyncio.run(main())
    assert seen["after"] == 200, seen
    failed, retried = _check_failover(single, before, _metrics(scaled.url), out, seen)
    print(f"killed {seen['victim']} with {seen['in_flight']} calls in flight: {retried} retried, {failed} failed")
    _wait_for_restart(scaled.url)


def _freeze(replica: str, how: str) -> int:
    """Freeze `replica`: its whole process (SIGSTOP) or only its engine thread (blocked in a command,
    reached through Ray's `__ray_call__` and Serve's replica internals: test-only); its pid."""
    import signal
    import time
    actor = _actor(replica)
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    if how == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        ray.get(actor.__ray_call__.remote(lambda self: self._replica_impl._user_callable_wrapper.user_callable
                                          .state.worker.call(lambda: time.sleep(3600)) and None))
    return pid


@pytest.mark.parametrize("how", ["sigstop", "stuck-engine"])
def test_a_frozen_replica_is_replaced_within_seconds_and_its_calls_fail_over(servers, how):
    """Ray's health check (every 2 s, 3 s to answer; a stuck engine thread fails it) stops the
    frozen replica after 3 failed checks: its calls not yet sending text are answered by the other
    replica, a stream already sending ends with replica_failed; ~12 s, not Ray's default ~130 s."""
    import signal
    import time
    single, scaled = servers
    before = _metrics(scaled.url)
    out, seen = {}, {}

    async def main():
        async with httpx.AsyncClient(base_url=scaled.url, headers=AUTH, timeout=300) as http:
            calls = await _load_a_replica(http, 2, out, seen)
            seen["pid"] = _freeze(seen["victim"], how)
            start = time.monotonic()
            await asyncio.gather(*calls)
            seen["answered_s"] = time.monotonic() - start
    try:
        asyncio.run(main())
    finally:
        try:
            os.kill(seen["pid"], signal.SIGCONT)   # if Ray has not killed it (a failed run)
        except (KeyError, ProcessLookupError):
            pass
    assert seen["answered_s"] < 45, seen   # detection ~11 s + the retried calls' own time on a busy machine
    failed, retried = _check_failover(single, before, _metrics(scaled.url), out, seen)
    print(f"{how}: {seen['victim']} with {seen['in_flight']} calls in flight, every call answered "
          f"{seen['answered_s']:.1f} s after the freeze: {retried} retried, {failed} failed")
    _wait_for_restart(scaled.url)


@pytest.fixture(scope="module")
def peer(servers):
    """A third app: 2 replicas behind the pbkv router, no shared directory, a queued request
    costing 10 s: a workflow's call goes to the idle replica while its home is busy, and fetches
    its prefix from the home when moving it beats recomputing it."""
    from pbkv.scale.serve_app import ReplicaOptions, ReplicaServer
    opts = ReplicaOptions(replicas=2, router="pbkv", app_name="pbkv-peer", stats_period_s=0.5, replica_cpus=0,
                          router_config={"prefill_s_per_token": 1e-3, "queue_s_per_request": 10.0})
    srv = ReplicaServer(dataclasses.replace(CFG, max_tokens_limit=4096), opts).start()
    yield srv
    srv.stop()


async def _one_process(url: str, prompts: list[str]) -> list[str]:
    """The single-process server's greedy answers (concurrent: the engine batches them)."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json={
            "model": "tiny", "prompt": p, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}) for p in prompts))
    return [a.json()["choices"][0]["text"] for a in answers]


def _wait_for_restart(url: str, timeout: float = 240.0) -> None:
    """Ray's controller replaces the dead replica: /health counts 2 answering replicas again."""
    import time
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        while time.monotonic() < deadline:
            if _metrics(url)["pbkv_replicas"] == 2:
                return
            http.get("/health")   # (a request between scrapes, no sleep: each scrape takes a while)
    pytest.fail("the killed replica was not replaced")


TRIP = ("An agent plans a trip: it reads the request, lists three cities, checks the weather in "
        "each, and writes a short plan with one line per day. ") * 3


def _served_by(before: dict, after: dict) -> str:
    """The one replica whose prompt tokens grew between two scrapes."""
    grew = [r for r, v in _per_replica(after, "pbkv_prompt_tokens_total").items()
            if v > _per_replica(before, "pbkv_prompt_tokens_total").get(r, 0)]
    assert len(grew) == 1, grew
    return grew[0]


def _complete(url: str, prompt: str, agent: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "workflow_id": "trip", "agent": agent}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_workflow_moved_to_the_other_replica_loads_its_prefix_from_the_shared_dir(servers, shared):
    single, _ = servers
    m0 = _metrics(shared.url)
    first = _complete(shared.url, TRIP, "planner")
    m1 = _metrics(shared.url)
    a = _served_by(m0, m1)
    blocks = first["usage"]["prompt_tokens"] // 16
    written = f'pbkv_shared_kv_files_written_total{{replica="{a}"}}'
    for _ in range(200):   # A writes its blocks on its I/O thread after the prefill (each scrape takes a while)
        if m1[written] == blocks:
            break
        m1 = _metrics(shared.url)
    assert m1[written] == blocks > 0
    second = _complete(shared.url, TRIP + "Now the agent books one hotel per city.", "booker")
    m2 = _metrics(shared.url)
    b = _served_by(m1, m2)
    assert b != a                                       # the workflow moved (round-robin)
    usage = second["usage"]
    shared_hit = usage["pbkv_cached_tokens"]["shared"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared_hit >= 16 * (blocks - 1) > 0
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits = 'pbkv_cache_hit_tokens_total{{replica="{}",tier="shared"}}'
    assert m2[hits.format(b)] - m1.get(hits.format(b), 0) == shared_hit   # counted on B, on tier "shared"
    assert m2[hits.format(a)] == 0 and m2["pbkv_shared_kv_corrupt_total"] == 0
    for got, prompt, agent in ((first, TRIP, "planner"), (second, TRIP + "Now the agent books one hotel per city.",
                                                          "booker")):
        want = _complete(single.url, prompt, agent)   # one process, no shared dir
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


async def _busy_home_then_move(url: str, prompt: str, more: str) -> tuple[dict, str]:
    """A long streamed call of workflow "moved" (its home replica stays busy), then, once it
    streams, the workflow's next call; returns that call's answer and the first call's text."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as http:
        first_text, text = asyncio.Event(), []

        async def long_call():
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                    "stream": True, "workflow_id": "moved", "agent": "planner"}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        first_text.set()

        task = asyncio.create_task(long_call())
        await asyncio.wait_for(first_text.wait(), 120)
        await asyncio.sleep(1.5)   # three routing-stats reports: the home's load is known
        body = {"model": "tiny", "prompt": prompt + more, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "workflow_id": "moved", "agent": "booker"}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert not task.done()         # the home was busy the whole time
        task.cancel()
        return r.json(), "".join(text)


def test_a_call_sent_away_from_its_busy_home_fetches_the_prefix_from_it(servers, peer):
    single, _ = servers
    more = "Now the agent books one hotel per city."
    m0 = _metrics(peer.url)
    moved, _ = asyncio.run(_busy_home_then_move(peer.url, TRIP, more))
    m1 = _metrics(peer.url)
    received = _per_replica(m1, "pbkv_peer_kv_blocks_received_total")
    sent = _per_replica(m1, "pbkv_peer_kv_blocks_sent_total")
    (b, n), = [(r, v) for r, v in received.items() if v > 0]
    (a, n_sent), = [(r, v) for r, v in sent.items() if v > 0]
    assert a != b and n == n_sent >= 2
    usage = moved["usage"]
    assert usage["pbkv_cached_tokens"]["shared"] == usage["prompt_tokens_details"]["cached_tokens"] == 16 * n
    hits = 'pbkv_cache_hit_tokens_total{{replica="{}",tier="shared"}}'
    assert m1[hits.format(b)] - m0.get(hits.format(b), 0) == 16 * n
    assert m1.get(f'pbkv_peer_kv_blocks_unused_total{{replica="{b}"}}', 0) == 0
    assert m1[f'pbkv_peer_kv_blocks_read_total{{replica="{b}"}}'] == n
    want = _complete(single.url, TRIP + more, "booker")   # one process, all computed
    assert moved["choices"][0]["text"] == want["choices"][0]["text"]
    assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]

