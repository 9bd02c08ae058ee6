"""A small hover workload replayed through vLLM alone and vLLM + the pbkv connector (docs/vllm.md).

    .venv-vllm/bin/python examples/vllm_figures.py --workflows 6 --blocks 24

pbkv's generator makes `--workflows` hover workflows, scaled down (`--scale`) for a CPU, their
blocks turned into real token ids (`TokenMapper`), replayed one call at a time in arrival order
(or `--concurrency N` workflows in flight) with the workflow hints in `kv_transfer_params`. Each
configuration runs in its own process (one engine each, `pbkv.bench.vllm_run`, the core of
`pbkv bench --engine vllm`): vLLM alone, then vLLM + connector with each `--policies` entry. vLLM gets a small
pool (`--blocks` x 32 tokens) so that prefixes leave it. Prints, per run: prompt tokens, prefill
tokens computed, hits from vLLM's prefix cache / the connector's RAM / its disk, wall time of the
replay (engine start excluded). The model is SmolLM2-135M as converted by pbkv (see .ci/run).
"""

import argparse
import json
import os
import sys
from pathlib import Path

from pbkv.bench.run import Workload
from pbkv.bench.vllm_run import VLLMConfig, VLLMRunError, run_policy
from pbkv.policy.registry import UnknownPolicy, needed_predictor, needs_future
from pbkv.workloads import generate, load_spec


def connector_jobs(policies: str, predictor: str | None) -> list[tuple[str, str | None]]:
    """(policy, predictor directory handed to the connector) per `--policies` entry, checked before
    any run (ValueError, one line): the connector refuses a predictor_dir for a policy that reads
    none (lru, pbkv-retired), so --predictor goes only to the policies whose
    `needed_predictor` is set, as `pbkv bench --engine vllm` does (sweep.py `_run_one`)."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--policies {policies!r}: names no policy")
    jobs = []
    for name in names:
        try:
            variant = needed_predictor(name)
            future = needs_future(name)
        except UnknownPolicy as e:
            raise ValueError(f"--policies: {e}") from None
        if future:
            raise ValueError(f"--policies: {name} reads the replayed trace's future; the connector cannot run it")
        if variant is not None and predictor is None:
            raise ValueError(f"--policies: {name} reads a trained predictor; give --predictor DIR "
                             f"(saved by `pbkv train`)")
        if variant not in (None, "fused"):
            raise ValueError(f"--policies: {name} reads the {variant!r} predictor variant; --predictor stands "
                             f"for the fused one (policy pbkv's)")
        jobs.append((name, predictor if variant else None))
    if predictor is not None:
        if not any(d for _, d in jobs):
            raise ValueError(f"--predictor {predictor}: none of --policies {','.join(names)} reads a trained "
                             f"predictor (pbkv does)")
        if not Path(predictor).is_dir():
            raise ValueError(f"--predictor {predictor}: not a directory")
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face model folder (default: pbkv's converted SmolLM2-135M in "
                                    "$PBKV_CACHE or ~/.cache/pbkv, converted first when it never was, as "
                                    "`pbkv bench --engine vllm` does)")
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
                    help="connector policies (`pbkv` needs --predictor, a predictor from `pbkv train`)")
    ap.add_argument("--predictor", help="a predictor directory saved by `pbkv train`, handed to the policies "
                                        "that read one (not lru, pbkv-retired)")
    ap.add_argument("--concurrency", type=int, help="workflows in flight (default: one call at a time)")
    args = ap.parse_args()
    if os.environ.get("PBKV_CACHE") == "":   # empty means unset, as pbkv.bench.predictors.cache_dir reads it
        del os.environ["PBKV_CACHE"]
    try:
        jobs = connector_jobs(args.policies, args.predictor)
    except ValueError as e:
        ap.exit(2, f"vllm_figures.py: error: {e}\n")
    try:
        run_all(args, jobs)
    except VLLMRunError as e:   # no vLLM venv, no model, a failed run: what to do, not a traceback
        ap.exit(1, f"vllm_figures.py: {e}\n")


def run_all(args, jobs: list[tuple[str, str | None]]) -> None:
    # the core lives in pbkv.bench.vllm_run (`pbkv bench --engine vllm`): one child process per setup
    cfg = VLLMConfig(python=sys.executable, model=args.model, scale=args.scale, blocks=args.blocks,
                     host_tokens=args.host_tokens, disk_tokens=args.disk_tokens, max_model_len=args.max_model_len,
                     max_tokens=args.max_tokens, seed=args.seed)
    workload = Workload(args.workload, generate(load_spec(args.workload), args.workflows, args.seed))
    rows = []
    for policy, predictor_dir in [("vllm", None)] + jobs:
        rows.append(run_policy(workload, policy, args.concurrency, cfg, predictor_dir))
        print(json.dumps(rows[-1]), file=sys.stderr)
    head = ["config", "calls", "prompt tok", "computed", "vLLM hit", "RAM hit", "disk hit", "demoted", "wall s"]
    print(" | ".join(head))
    for r in rows:
        name = "vLLM alone" if r["policy"] == "vllm" else f"vLLM + pbkv ({r['policy']})"
        print(" | ".join(str(x) for x in (name, r["calls"], r["prompt_tokens"], r["computed_tokens"],
                                           r["vllm_hit_tokens"], r["ram_hit_tokens"], r["disk_hit_tokens"],
                                           r["demoted_blocks"], f"{r['wall_seconds']:.1f}")))


if __name__ == "__main__":
    main()
