"""A small hover workload replayed through vLLM alone and vLLM + the pbkv connector (docs/vllm.md).

    .venv-vllm/bin/python examples/vllm_figures.py --workflows 6 --blocks 24

pbkv's generator makes `--workflows` hover workflows, scaled down (`--scale`) for a CPU, their
blocks turned into real token ids (`TokenMapper`), replayed one call at a time in arrival order
with the workflow hints in `kv_transfer_params`. Each configuration runs in its own process (one
engine each): vLLM alone, then vLLM + connector with each `--policies` entry. vLLM gets a small
pool (`--blocks` x 32 tokens) so that prefixes leave it. Prints, per run: prompt tokens, prefill
tokens computed, hits from vLLM's prefix cache / the connector's RAM / its disk, wall time of the
replay (engine start excluded). The model is SmolLM2-135M as converted by pbkv (see .ci/run).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def replay(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from pbkv.engine.hf.tokens import TokenMapper, scale_trace
    from pbkv.integrations.vllm import kv_transfer_config
    from pbkv.workloads import generate, load_spec

    trace = scale_trace(generate(load_spec(args.workload), args.workflows, args.seed), args.scale)
    # arrival order; generated traces carry no times: round-robin over workflows, step by step
    calls = sorted(trace.calls, key=lambda c: (c.step if c.t is None else c.t, c.workflow_id, c.step))
    kw = dict(model=args.model, dtype="float32", block_size=32, max_model_len=args.max_model_len, seed=0,
              enable_prefix_caching=True, num_gpu_blocks_override=args.blocks, gpu_memory_utilization=0.5)
    stats = None
    if args.policy != "off":
        stats = Path(tempfile.mkdtemp(prefix="pbkv-fig-")) / "stats.json"
        extra = dict(host_tokens=args.host_tokens, disk_tokens=args.disk_tokens, stats_path=str(stats))
        if args.model_dir:
            extra["model_dir"] = args.model_dir
        kw["kv_transfer_config"] = kv_transfer_config(args.policy, **extra)
    llm = LLM(**kw)
    mapper = TokenMapper(llm.get_tokenizer().vocab_size, trace.block_size, seed=args.seed)
    limit = args.max_model_len - args.max_tokens
    prompt_tokens = cached = skipped = 0
    t0 = time.perf_counter()
    for c in calls:
        prompt = mapper.tokens(c)
        if len(prompt) > limit:
            skipped += 1
            continue
        hints = {"workflow_id": c.workflow_id, "agent": c.agent, "workflow_done": bool(c.done)}
        sp = SamplingParams(temperature=0, max_tokens=max(1, min(args.max_tokens, c.output_length)),
                            extra_args={"kv_transfer_params": hints})
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        prompt_tokens += len(prompt)
        cached += o.num_cached_tokens or 0
    fig = {"policy": args.policy, "calls": len(calls) - skipped, "skipped": skipped, "prompt_tokens": prompt_tokens,
           "computed_tokens": prompt_tokens - cached, "cached_tokens": cached, "wall_s": time.perf_counter() - t0}
    if stats is not None and stats.exists():
        s = json.loads(stats.read_text())
        fig.update(gpu_hit_tokens=s["gpu_hit_tokens"], host_hit_tokens=s["host_hit_tokens"],
                   disk_hit_tokens=s["disk_hit_tokens"], gpu_demoted_blocks=s["gpu_demoted_blocks"])
    else:
        fig.update(gpu_hit_tokens=cached, host_hit_tokens=0, disk_hit_tokens=0, gpu_demoted_blocks=0)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(os.environ.get("PBKV_CACHE", Path.home() / ".cache" / "pbkv"))
                                           / "smollm2-135m-instruct"))
    ap.add_argument("--workload", default="hover")
    ap.add_argument("--workflows", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=12.0, help="divide prompt lengths by this")
    ap.add_argument("--blocks", type=int, default=24, help="vLLM's KV pool, in blocks of 32 tokens")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4, help="cap on each call's output (CPU time)")
    ap.add_argument("--host-tokens", type=int, default=512)
    ap.add_argument("--disk-tokens", type=int, default=16384)
    ap.add_argument("--policies", default="lru,pbkv-retired",
                    help="connector policies (`pbkv` needs --model-dir, a predictor from `pbkv train`)")
    ap.add_argument("--model-dir")
    ap.add_argument("--policy", help=argparse.SUPPRESS)   # one run, in a child process
    args = ap.parse_args()
    if args.policy:
        print("FIG" + json.dumps(replay(args)), flush=True)
        return
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    for policy in ["off"] + [p for p in args.policies.split(",") if p]:
        p = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--policy", policy], env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{policy}: failed\n{p.stderr[-3000:]}")
        rows.append(json.loads(next(x for x in p.stdout.splitlines() if x.startswith("FIG"))[3:]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    head = ["config", "calls", "prompt tok", "computed", "vLLM hit", "RAM hit", "disk hit", "demoted", "wall s"]
    print(" | ".join(head))
    for r in rows:
        name = "vLLM alone" if r["policy"] == "off" else f"vLLM + pbkv ({r['policy']})"
        print(" | ".join(str(x) for x in (name, r["calls"], r["prompt_tokens"], r["computed_tokens"],
                                           r["gpu_hit_tokens"], r["host_hit_tokens"], r["disk_hit_tokens"],
                                           r["gpu_demoted_blocks"], f"{r['wall_s']:.1f}")))


if __name__ == "__main__":
    main()
