"""Two real vLLM engines (CPU, SmolLM2, one after the other, separate processes) sharing the pbkv
connector's `shared_dir`: the second loads the prefixes the first computed, with identical greedy
outputs; a third, whose shared files are all corrupt, recomputes them and keeps no wrong KV.
Slow (three engine starts): marked `vllm`, run by `.ci/run`'s second step."""

import json
import os
import subprocess
import sys

import pytest

from test_vllm_engine import MODEL

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here (its tests run in .venv-vllm: see .ci/run)")

SCRIPT = r'''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from pbkv.integrations.vllm import kv_transfer_config
model, shared, stats, again = sys.argv[1:5]
llm = LLM(model=model, dtype="float32", block_size=32, max_model_len=384, enable_prefix_caching=True, seed=0,
          num_gpu_blocks_override=14, gpu_memory_utilization=0.5,
          kv_transfer_config=kv_transfer_config("lru", shared_dir=shared, stats_path=stats))
import random
rng = random.Random(0)
system = [rng.randrange(1000, 40000) for _ in range(160)]
out, tasks = [], [[rng.randrange(1000, 40000) for _ in range(100)] for _ in range(3)]
for t in list(range(3)) + [0] * (again == "again"):   # task 0 again: its own blocks left vLLM's 14-block pool
    sp = SamplingParams(temperature=0, max_tokens=6, extra_args={"kv_transfer_params": {"workflow_id": f"t{t}"}})
    o = llm.generate([{"prompt_token_ids": system + tasks[t]}], sp, use_tqdm=False)[0]
    out.append(list(o.outputs[0].token_ids))
print("OUT" + json.dumps(out))
'''


def run(tmp_path, name, again=False):
    stats = tmp_path / f"stats-{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}   # vllm 0.32 + sha256: a fixed seed
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(MODEL), str(tmp_path / "shared"), str(stats),
                        "again" if again else "once"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("OUT"))[3:])
    return out, json.loads(stats.read_text())


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason=f"SmolLM2 not converted at {MODEL}")
def test_a_second_instance_loads_the_first_ones_blocks(tmp_path):
    first, s1 = run(tmp_path, "a")
    second, s2 = run(tmp_path, "b")
    print("instance A:", json.dumps(s1), "\ninstance B:", json.dumps(s2))
    assert s1["shared_hit_tokens"] == 0
    # B's first prompt comes whole from A's files; later ones share the system prompt, which B then
    # also holds itself: every full block (8 of 32 tokens per 260-token prompt) is a hit somewhere
    assert s2["shared_hit_tokens"] >= 256
    assert s2["computed_tokens"] == 3 * 4 < s1["computed_tokens"]
    assert second == first


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason=f"SmolLM2 not converted at {MODEL}")
def test_corrupt_shared_blocks_are_recomputed_and_never_kept(tmp_path):
    """Every shared file damaged: the loads fail, vLLM recomputes (the helper's failure policy),
    and nothing computed from the damaged blocks reaches the connector's RAM: task 0, asked again
    once its own blocks left vLLM's pool, is loaded from RAM with the same greedy output."""
    first, _ = run(tmp_path, "a")
    files = list((tmp_path / "shared").rglob("*.safetensors"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-50] ^= 0xFF
        f.write_bytes(bytes(raw))
    again, s = run(tmp_path, "c", again=True)
    print("instance C:", json.dumps(s))
    assert again == first + first[:1]
    assert files and s["load_failed_blocks"] > 0 and s["host_hit_tokens"] > 0
