"""Two `pbkv serve` instances sharing one KV directory: B serves A's workflow prompt from it."""

from __future__ import annotations

import httpx
import openai

from serve_helpers import start_server, torch_threads  # noqa: F401
from pbkv.cache import CacheConfig
from pbkv.serve.metrics import parse

PROMPT = ("An agent plans a trip: it reads the request, lists three cities, checks the weather in "
          "each, and writes a short plan with one line per day. ") * 3


def test_second_server_loads_the_first_ones_prefix_from_the_shared_dir(tmp_path, torch_threads):  # noqa: F811
    cache = CacheConfig(device_tokens=8192, shared_dir=str(tmp_path / "kv"), shared_bytes=64 << 20)
    a, b = start_server(policy="lru", cache=cache), start_server(policy="lru", cache=cache)
    alone = start_server(policy="lru")
    try:
        answers = {}
        for name, srv in (("a", a), ("b", b), ("alone", alone)):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            answers[name] = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                extra_body={"workflow_id": "trip-1", "agent": "planner", "ignore_eos": True})
            if name == "a":   # A's blocks are written on its worker thread, after the prefill
                srv.state.worker.engine.store.worker.drain()
        got, first = answers["b"].usage, answers["a"].usage
        assert first.prompt_tokens_details.cached_tokens == 0
        shared = got.model_extra["pbkv_cached_tokens"]["shared"]
        assert got.prompt_tokens_details.cached_tokens == shared > 0
        assert shared == (got.prompt_tokens // 16) * 16 or shared == got.prompt_tokens - 1
        assert answers["b"].choices[0].text == answers["alone"].choices[0].text == answers["a"].choices[0].text
        values = parse(httpx.get(b.url + "/metrics").text)
        assert values['pbkv_cache_hit_tokens_total{tier="shared"}'] == shared
        assert values['pbkv_cache_loaded_tokens_total{tier="shared"}'] == shared
        assert values['pbkv_shared_kv_corrupt_total'] == 0
        assert parse(httpx.get(a.url + "/metrics").text)["pbkv_shared_kv_files_written_total"] \
            == first.prompt_tokens // 16
    finally:
        for srv in (a, b, alone):
            srv.stop()
