"""Figures for `pbkv serve --replicas 2` on CPU, per router (a benchmark, not a test):

    python -m pbkv.scale.bench_serve --trace ../shared/traces/chatdev-dev.jsonl --hover-workflows 20
    python -m pbkv.scale.bench_serve --hover-workflows 24 --routers round-robin,pbkv --shared-dir /tmp/kv

For each workload (a `pbkv gen hover` replay, and the given trace file) and each router, a fresh
engine deployment (2 `tiny` replicas, fresh caches) behind a fresh ingress replays the workload
over HTTP (`/v1/completions` with the prompt as token ids from `TokenMapper`, so prefix sharing
in the trace is real; workflow hints; greedy, `ignore_eos`, outputs as the trace says), with
`--clients` workflows at a time. Reported, from the ingress's /metrics (summed over replicas):
prompt tokens whose KV came from each tier (`shared`: the directory given by `--shared-dir`,
which every replica reads and writes; each run gets a fresh subfolder), tokens computed by prefill, calls per replica, wall
time and call latency p50/p99, and KV blocks moved between replicas on the router's decision
(`peer_blocks_moved`; `--no-fetch` turns that off; `--measured-costs`: the router's prefill and
transfer costs follow the replicas' measurements instead of `CPU_COSTS`). Lengths are divided by `--scale` (outputs by
`--output-scale`).
Then the routing overhead: 64 clients x 8 calls against 2 model-free `Probe` replicas (20 ms of
service) with each router and with Ray's default one: end-to-end p50/p99 latency (and the
difference to Ray's default router, noisy on a loaded machine) and the p50/p99 time of pbkv's
routing decision itself (`adapter.decision_seconds`, measured inside the router).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import httpx

from pbkv.cache import CacheConfig
from pbkv.files import check_output_file, replaced_on_success
from pbkv.scale.serve_app import ReplicaOptions, ReplicaServer, default_router_config, start_ray
from pbkv.serve import ServeConfig
from pbkv.serve.metrics import parse
from pbkv.trace import Trace

ROUTERS = "round-robin,least-load,prefix,sticky,pbkv"


def workloads(args) -> dict[str, Trace]:
    from pbkv.engine.hf import scale_trace
    from pbkv.trace import read_trace
    from pbkv.workloads import generate
    out = {}
    if args.hover_workflows:
        out["hover"] = generate("hover", args.hover_workflows, args.seed)
    if args.trace:
        trace = read_trace(args.trace)
        keep = sorted({c.workflow_id for c in trace.calls})[:args.trace_workflows]
        out[args.trace.rsplit("/", 1)[-1].removesuffix(".jsonl")] = Trace(
            meta=trace.meta, calls=[c for c in trace.calls if c.workflow_id in set(keep)])
    return {name: scale_trace(t, args.scale, args.output_scale) for name, t in out.items()}


def _workflows(trace: Trace) -> list[list]:
    by_id: dict[str, list] = {}
    for c in trace.calls:
        by_id.setdefault(c.workflow_id, []).append(c)
    return [sorted(calls, key=lambda c: c.step) for calls in by_id.values()]


async def replay(url: str, trace: Trace, clients: int, max_tokens: int) -> list[float]:
    """Every workflow's calls in order, `clients` workflows at a time; call latencies (s)."""
    from pbkv.engine.hf import TokenMapper
    mapper = TokenMapper(512, trace.block_size)   # the tiny model's vocabulary
    queue = _workflows(trace)
    latencies: list[float] = []

    async def client(http):
        while queue:
            calls = queue.pop(0)
            for k, call in enumerate(calls):
                body = {"model": "tiny", "prompt": mapper.tokens(call), "temperature": 0, "ignore_eos": True,
                        "max_tokens": max(1, min(call.output_length, max_tokens)), "workflow_id": call.workflow_id,
                        "agent": call.agent, "workflow_done": k == len(calls) - 1}
                start = time.perf_counter()
                r = await http.post("/v1/completions", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_cfg(cfg: ServeConfig, workload: str, router: str, args) -> ServeConfig:
    """`cfg` with a fresh shared subfolder for this run (`--shared-dir`), else unchanged."""
    if not args.shared_dir:
        return cfg
    folder = Path(args.shared_dir) / f"{workload}-{router}"
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} is not empty: give --shared-dir a fresh folder (runs must start cold)")
    cache = dataclasses.replace(cfg.cache, shared_dir=str(folder), shared_bytes=args.shared_bytes)
    return dataclasses.replace(cfg, cache=cache)


def run_one(cfg: ServeConfig, router: str, trace: Trace, args) -> dict:
    config = default_router_config() | {"can_fetch": False} if args.no_fetch else None
    opts = ReplicaOptions(replicas=args.replicas, router=router, app_name=f"bench-{router}", stats_period_s=0.5,
                          router_config=config, measured_costs=args.measured_costs)
    with ReplicaServer(cfg, opts) as srv:
        start = time.perf_counter()
        lat = asyncio.run(replay(srv.url, trace, args.clients, args.max_tokens))
        wall = time.perf_counter() - start
        m = parse(httpx.get(f"{srv.url}/metrics", timeout=60).text)
    per_replica = {k.split('"')[1]: v for k, v in m.items() if k.startswith('pbkv_prompt_tokens_total{replica=')}
    return {"router": router, "fetch": not args.no_fetch, "measured_costs": args.measured_costs, "shared_dir": cfg.cache.shared_dir is not None,
            "calls": len(lat), "wall_s": round(wall, 1), "p50_s": round(_pct(lat, 0.5), 3),
            "p99_s": round(_pct(lat, 0.99), 3), "prompt_tokens": m["pbkv_prompt_tokens_total"],
            **{f"hit_{t}": m[f'pbkv_cache_hit_tokens_total{{tier="{t}"}}'] for t in ("device", "host", "disk", "shared")},
            "computed_tokens": m["pbkv_cache_recomputed_tokens_total"],
            "shared_files_written": m.get("pbkv_shared_kv_files_written_total", 0),
            "peer_blocks_moved": m.get("pbkv_peer_kv_blocks_received_total", 0),
            "peer_blocks_read": m.get("pbkv_peer_kv_blocks_read_total", 0),
            "peer_blocks_unused": m.get("pbkv_peer_kv_blocks_unused_total", 0),
            "prompt_tokens_per_replica": sorted(per_replica.values()),
            "retried": m["pbkv_replica_retried_requests_total"], "failed": m["pbkv_replica_failed_requests_total"]}


def routing_overhead(routers: list[str], clients: int) -> list[dict]:
    from ray import serve

    from pbkv.scale.probe import overhead, probe_app
    from pbkv.scale.adapter import decision_seconds
    out = []
    for router in [None, *routers]:
        name = f"probe-{router or 'ray-default'}"
        handle = serve.run(probe_app(2, router, service_s=0.02), name=name, route_prefix=None)
        decision_seconds(clear=True)
        row = {"router": router or "ray-default", **overhead(handle, clients=clients, steps=8)}
        took = decision_seconds(clear=True)
        row["decision_p50_ms"] = round(1000 * _pct(took, 0.5), 3)
        row["decision_p99_ms"] = round(1000 * _pct(took, 0.99), 3)
        out.append(row)
        serve.delete(name)
    base = out[0]
    for row in out:
        row["added_p50_ms"] = round(1000 * (row["p50_s"] - base["p50_s"]), 1)
        row["added_p99_ms"] = round(1000 * (row["p99_s"] - base["p99_s"]), 1)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="a trace file to replay (e.g. ../shared/traces/chatdev-dev.jsonl)")
    p.add_argument("--trace-workflows", type=int, default=24, help="its first N workflows (by id)")
    p.add_argument("--hover-workflows", type=int, default=24, help="workflows of `pbkv gen hover` (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routers", default=ROUTERS)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=8, help="workflows replayed at a time")
    p.add_argument("--scale", type=float, default=8.0, help="prompt lengths divided by this")
    p.add_argument("--output-scale", type=float, default=32.0, help="output lengths divided by this")
    p.add_argument("--max-tokens", type=int, default=16, help="cap on each call's output tokens")
    p.add_argument("--device-tokens", type=int, default=2048, help="per replica")
    p.add_argument("--host-tokens", type=int, default=4096, help="per replica")
    p.add_argument("--shared-dir", help="a folder for the replicas' shared KV tier (one fresh subfolder per run; "
                                        "default: no shared tier)")
    p.add_argument("--shared-bytes", type=int, default=1 << 30, help="bound of each run's shared subfolder")
    p.add_argument("--no-fetch", action="store_true", help="replicas never move KV between them (can_fetch False)")
    p.add_argument("--measured-costs", action="store_true",
                   help="the router weighs the prefill and transfer costs the replicas measure (else CPU_COSTS)")
    p.add_argument("--overhead-clients", type=int, default=64, help="0: skip the routing-overhead runs")
    p.add_argument("--out", help="write every row as JSON lines here")
    args = p.parse_args(argv)
    if args.out:
        try:   # before Ray starts and minutes of replays: the same check as every `pbkv` command's output
            check_output_file(Path(args.out))
        except ValueError as e:
            p.error(f"--out: {e}")
    routers = args.routers.split(",")
    start_ray(ReplicaOptions(replicas=args.replicas), log_to_driver=False)
    cfg = ServeConfig(model="tiny", port=0, threads=1, max_tokens_limit=1024, idle_timeout=600.0,
                      cache=CacheConfig(args.device_tokens, args.host_tokens, 0))
    rows = []
    for name, trace in workloads(args).items():
        print(f"\n{name}: {len({c.workflow_id for c in trace.calls})} workflows, {len(trace.calls)} calls, "
              f"{args.replicas} replicas, {args.clients} clients", flush=True)
        for router in routers:
            row = {"workload": name} | run_one(run_cfg(cfg, name, router, args), router, trace, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.overhead_clients:
        print(f"\nrouting overhead, {args.overhead_clients} clients x 8 calls, 2 Probe replicas (20 ms):", flush=True)
        for row in routing_overhead(routers, args.overhead_clients):
            rows.append({"workload": "overhead"} | row)
            print(json.dumps(row), flush=True)
    if args.out:   # its folder made, the file whole or not at all, as every pbkv output
        with replaced_on_success(args.out) as tmp, open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
