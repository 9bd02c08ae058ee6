#!/usr/bin/env python3
"""Figures for `pbkv serve`: calls/s and p50/p99 call latency at 1, 8, 64 concurrent clients, with
workflow hints and without; then hit rates per cache tier after a 200-workflow run of the
multi-agent example, and what /metrics shows at the end.

Each cell starts a fresh `pbkv serve` subprocess on a free loopback port (so no cell inherits
another's cache) and runs the example's workflows (`multi_agent.py`) with N client threads,
each running workflows back to back. A cell's "dev hit" is the device share of the prompt tokens of
its measured workflows (the /metrics counters after its warm-up subtracted); "recomputed" is the
share of prompt tokens prefilled anew (/metrics' recomputed tokens: hits from the shared tier,
`--server-arg=--shared-dir=DIR`, are hits; every cell's server then reads that same DIR, so cells
do inherit each other's KV through it).

    python examples/load_test.py                       # tiny model, about 5 minutes on 2 cores
    python examples/load_test.py --clients 1,8 --final-workflows 50 --json figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multi_agent  # noqa: E402  (the example next to this file)

from pbkv.driver.metrics import percentile  # noqa: E402
from pbkv.serve.metrics import TIERS, parse  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(args, extra: list[str] = ()):
    port = free_port()
    cmd = [sys.executable, "-c", "from pbkv.cli import app; app()", "serve", "--model", args.model,
           "--policy", args.policy, "--port", str(port), "--device-tokens", str(args.device_tokens),
           "--host-tokens", str(args.host_tokens), "--disk-tokens", str(args.disk_tokens),
           "--log-level", "warning", "--threads", str(args.threads), *args.server_arg, *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for the subprocess to come up
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pbkv serve did not start: {' '.join(cmd)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def token_counts(m: dict[str, float]) -> dict[str, float]:
    """Prompt tokens served so far, their hit tokens per tier (device, host, disk, shared) and the
    recomputed ones, from parsed /metrics counters."""
    out = {"prompt": m.get("pbkv_prompt_tokens_total", 0.0),
           "recomputed": m.get("pbkv_cache_recomputed_tokens_total", 0.0)}
    for t in TIERS:
        out[t] = m.get(f'pbkv_cache_hit_tokens_total{{tier="{t}"}}', 0.0)
    return out


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per tier and "recomputed": its share of the prompt tokens served between two snapshots of
    `token_counts` (0 when none were)."""
    prompt = after["prompt"] - before["prompt"]
    return {k: (after[k] - before[k]) / prompt if prompt else 0.0 for k in (*TIERS, "recomputed")}


def cell(args, clients: int, hints: bool) -> dict:
    workflows = max(args.min_workflows, args.workflows_per_client * clients)
    with server(args) as url:
        multi_agent.run_many(url + "/v1", args.model, 2, 2, seed=99, hints=hints,
                             max_tokens=args.max_tokens)  # warm-up, not measured
        before = token_counts(parse(httpx.get(url + "/metrics").text))
        start = time.perf_counter()
        calls = multi_agent.run_many(url + "/v1", args.model, workflows, clients, seed=args.seed, hints=hints,
                                     max_tokens=args.max_tokens)
        wall = time.perf_counter() - start
        after = token_counts(parse(httpx.get(url + "/metrics").text))
    lat = [c.seconds for c in calls]
    return {"clients": clients, "hints": hints, "workflows": workflows, "calls": len(calls), "seconds": wall,
            "rps": len(calls) / wall, "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
            "device_hit_rate": shares(before, after)["device"]}


def final_run(args) -> tuple[dict, str]:
    with server(args, ["--learn-every", str(args.learn_every)]) as url:
        start = time.perf_counter()
        calls = multi_agent.run_many(url + "/v1", args.model, args.final_workflows, args.final_clients,
                                     seed=args.seed + 1, hints=True, max_tokens=args.max_tokens)
        wall = time.perf_counter() - start
        text = httpx.get(url + "/metrics").text
    share = shares(token_counts({}), token_counts(parse(text)))
    return {"workflows": args.final_workflows, "clients": args.final_clients, "calls": len(calls), "seconds": wall,
            "hit_rate": {t: share[t] for t in TIERS}, "recomputed_share": share["recomputed"]}, text


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the option (no usage block), exit 2."""
        self.exit(2, f"load_test.py: error: {message}\n")


def check(ap: argparse.ArgumentParser, args) -> list[int]:
    """Every argument checked before any server starts (one line naming the option, exit 2);
    the client counts of the cells."""
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--clients {args.clients!r}: not a comma-separated list of whole numbers")
    if not clients or min(clients) < 1:
        ap.error(f"--clients {args.clients!r}: each cell needs at least 1 client")
    for opt, least in (("workflows_per_client", 1), ("min_workflows", 0), ("max_tokens", 1), ("device_tokens", 1),
                       ("host_tokens", 0), ("disk_tokens", 0), ("final_workflows", 1), ("final_clients", 1),
                       ("learn_every", 1), ("threads", 1)):
        if getattr(args, opt) < least:
            ap.error(f"--{opt.replace('_', '-')} {getattr(args, opt)}: must be at least {least}")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        ap.error(f"--json {args.json}: not a file in an existing folder")
    return clients


def write_json(path: Path | None, rows: list[dict], final: dict | None) -> None:
    """The figures so far (`final` None until the final run is done), written atomically: a run
    cut short keeps every cell measured."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"cells": rows, "final": final}, indent=1) + "\n")
    os.replace(tmp, path)


def main() -> None:
    ap = Parser(description="pbkv serve figures (see the module docstring)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policy", default="pbkv")
    ap.add_argument("--clients", default="1,8,64")
    ap.add_argument("--workflows-per-client", type=int, default=2)
    ap.add_argument("--min-workflows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=4096)
    ap.add_argument("--host-tokens", type=int, default=8192)
    ap.add_argument("--disk-tokens", type=int, default=32768)
    ap.add_argument("--final-workflows", type=int, default=200)
    ap.add_argument("--final-clients", type=int, default=16)
    ap.add_argument("--learn-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server (1 is fastest for tiny)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for every `pbkv serve` (repeatable), e.g. --server-arg=--no-online")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cells = check(ap, args)

    rows = []
    try:
        final, text = measure(args, cells, rows)
    except KeyboardInterrupt:   # Ctrl-C: queued workflows cancelled, servers stopped; what was measured stays
        kept = f", in {args.json}" if args.json else ""
        print(f"\ninterrupted: {len(rows)} of {2 * len(cells)} cells measured{kept}; no final run", file=sys.stderr)
        sys.exit(130)
    except (httpx.HTTPError, multi_agent.openai.APIError, RuntimeError) as e:
        sys.exit(f"load_test.py: {e}")
    h = final["hit_rate"]
    print(f"\n{final['workflows']} workflows ({final['calls']} calls, {final['clients']} clients, "
          f"{final['seconds']:.0f} s): hit rate device {h['device']:.3f}, host {h['host']:.3f}, "
          f"disk {h['disk']:.3f}, shared {h['shared']:.3f}, recomputed {final['recomputed_share']:.3f}")
    print("\n/metrics at the end (samples only):")
    print("\n".join(line for line in text.splitlines() if line and not line.startswith("#")
                    and "_bucket" not in line))
    write_json(args.json, rows, final)


def measure(args, cells: list[int], rows: list[dict]) -> tuple[dict, str]:
    """Every cell (appended to `rows`, --json rewritten after each), then the final run."""
    print(f"{'clients':>7} {'hints':>5} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'dev hit':>8}")
    for clients in cells:
        for hints in (True, False):
            r = cell(args, clients, hints)
            rows.append(r)
            write_json(args.json, rows, None)
            print(f"{clients:>7} {str(hints):>5} {r['calls']:>6} {r['rps']:>8.1f} {1e3 * r['p50_s']:>8.0f} "
                  f"{1e3 * r['p99_s']:>8.0f} {r['device_hit_rate']:>8.3f}", flush=True)
    return final_run(args)


if __name__ == "__main__":
    main()
