"""A real vLLM engine on CPU with SmolLM2 and the pbkv connector: greedy outputs identical to vLLM
alone, and the connector serves prefixes that vLLM's small GPU pool lost.

vLLM gets 14 blocks of 32 tokens (448 tokens: one prompt and a bit); six tasks share a system
prompt and each runs a planner then a worker call twice around, so by a task's second round its
blocks have left vLLM's pool and come back from the connector's RAM or disk tier (RAM is kept
small so that some go to disk). Figures are printed (`pytest -s`).

Slow (two engine starts, ~2 x 90 s on 2 cores): marked `vllm`, run by `.ci/run`'s second step
(`.venv-vllm/bin/python -m pytest -m vllm`). Skipped without vLLM or the converted SmolLM2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here (its tests run in .venv-vllm: see .ci/run)")

MODEL = Path(os.environ.get("PBKV_CACHE", Path.home() / ".cache" / "pbkv")) / "smollm2-135m-instruct"

SCRIPT = r'''
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from pbkv.integrations.vllm import kv_transfer_config
model, use, stats = sys.argv[1], sys.argv[2] == "on", sys.argv[3]
kw = dict(model=model, dtype="float32", block_size=32, max_model_len=384, enable_prefix_caching=True, seed=0,
          num_gpu_blocks_override=14, gpu_memory_utilization=0.5)
if use:
    kw["kv_transfer_config"] = kv_transfer_config("pbkv-retired", host_tokens=256, disk_tokens=4096,
                                                  stats_path=stats)
llm = LLM(**kw)
import random
rng = random.Random(0)
system = [rng.randrange(1000, 40000) for _ in range(160)]
tasks = [[rng.randrange(1000, 40000) for _ in range(130)] for _ in range(6)]
out, prompt_tokens, cached = [], 0, 0
t0 = time.perf_counter()
# a small workflow per task: planner, then worker over the planner's prompt, twice around
for rnd in range(2):
    for t, task in enumerate(tasks):
        for agent in ("planner", "worker"):
            prompt = system + task + ([7, 8, 9] * 10 if agent == "worker" else [])
            done = rnd == 1 and agent == "worker"
            sp = SamplingParams(temperature=0, max_tokens=6, extra_args={"kv_transfer_params":
                {"workflow_id": f"task-{t}", "agent": agent, "workflow_done": done}})
            o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            out.append(list(o.outputs[0].token_ids))
            prompt_tokens += len(prompt)
            cached += o.num_cached_tokens or 0
wall = time.perf_counter() - t0
print("OUT" + json.dumps({"out": out, "requests": len(out), "prompt_tokens": prompt_tokens,
                          "cached_tokens": cached, "computed_tokens": prompt_tokens - cached, "wall_s": wall}))
'''


def run(mode, tmp_path):
    stats = tmp_path / f"stats-{mode}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(MODEL), mode, str(stats)], capture_output=True,
                       text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("OUT"))
    fig = json.loads(line[3:])
    return fig, (json.loads(stats.read_text()) if stats.exists() else None)


@pytest.mark.skipif(not (MODEL / "config.json").exists(),
                    reason=f"SmolLM2 not converted at {MODEL} (run `pbkv bench --engine hf --model smollm2` once)")
def test_greedy_identical_and_connector_hits(tmp_path):
    plain, _ = run("off", tmp_path)
    with_pbkv, stats = run("on", tmp_path)
    for name, fig in (("vLLM alone", plain), ("vLLM + pbkv", with_pbkv)):
        print(f"{name}: {fig['requests']} requests, prompt tokens {fig['prompt_tokens']}, "
              f"computed {fig['computed_tokens']}, cached {fig['cached_tokens']}, wall {fig['wall_s']:.1f} s")
    print("connector stats:", json.dumps(stats))
    assert with_pbkv["out"] == plain["out"]
    assert stats["saved_tokens"] > 0
    # the workers' own counters reach the stats JSON through vLLM (kv_connector_stats): every
    # save and load the scheduler planned was done
    block = stats["saved_tokens"] // stats["worker"]["saved_blocks"]
    assert stats["worker"]["saved_blocks"] * block == stats["saved_tokens"], stats
    # per tier: a disk hit is read into RAM by a move, then loaded, and counts as a disk load
    assert stats["worker"]["loaded_ram_blocks"] * block == stats["host_hit_tokens"], stats
    assert stats["worker"]["loaded_disk_blocks"] * block == stats["disk_hit_tokens"], stats
    served = stats["host_hit_tokens"] + stats["disk_hit_tokens"]
    assert served > 0, stats
    # vLLM's own count of cached tokens includes what the connector loaded
    assert with_pbkv["cached_tokens"] == stats["gpu_hit_tokens"] + served, (with_pbkv, stats)
    assert with_pbkv["computed_tokens"] < plain["computed_tokens"]
