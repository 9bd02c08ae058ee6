"""Show and save a sweep: a table per workload, the JSON records, PNG plots per workload."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _fmt(v, pct=False):
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def tables(records: list[dict]) -> list[Table]:
    out = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload]
        first = rows[0]
        if first.get("engine") in ("hf", "vllm"):
            out.append((hf_table if first["engine"] == "hf" else vllm_table)(workload, rows))
            continue
        t = Table(title=f"{workload}: {first['workflows']} workflows; KV tokens device {first['device_tokens']:,}, "
                        f"host {first['host_tokens']:,}, disk {first['disk_tokens']:,}",
                  caption="lat/p99: workflow latency s; hit: % of prompt tokens; recomp: M tokens "
                          "recomputed; GB in: loaded to device; xLRU: LRU latency / policy latency")
        if "router" in first:
            out.append(router_table(workload, rows))
            continue
        for col in ("conc", "policy", "lat", "p99", "TTFT", "dev", "host", "disk", "recomp", "GB in", "xLRU"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            t.add_row(str(r["concurrency"] or "open"), r["policy"], _fmt(r["mean_workflow_latency_s"]),
                      _fmt(r["p99_workflow_latency_s"]), _fmt(r["mean_ttft_s"]),
                      _fmt(r["device_hit_rate"], True), _fmt(r["host_hit_rate"], True),
                      _fmt(r["disk_hit_rate"], True), f"{r['recomputed_tokens'] / 1e6:.2f}",
                      f"{r['bytes_loaded'] / 1e9:.0f}", f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-")
        out.append(t)
    return out


def router_table(workload: str, rows: list[dict]) -> Table:
    """Several simulated instances: routers side by side (per instance capacities in the title)."""
    first = rows[0]
    t = Table(title=f"{workload}: {first['workflows']} workflows on {first['instances']} instances ({first['link']} "
                    f"links); KV tokens per instance device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                    f"disk {first['disk_tokens']:,}",
              caption="lat/p99: workflow latency s; hit: % of prompt tokens; recomp: M tokens recomputed; "
                      "GB moved: KV sent between instances; moves: calls placed off their workflow's last instance")
    for col in ("conc", "router", "policy", "lat", "p99", "TTFT", "dev", "host", "disk", "recomp", "GB moved",
                "moves"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["router"], r["policy"], _fmt(r["mean_workflow_latency_s"]),
                  _fmt(r["p99_workflow_latency_s"]), _fmt(r["mean_ttft_s"]), _fmt(r["device_hit_rate"], True),
                  _fmt(r["host_hit_rate"], True), _fmt(r["disk_hit_rate"], True),
                  f"{r['recomputed_tokens'] / 1e6:.2f}", f"{r['bytes_moved_between_instances'] / 1e9:.1f}",
                  str(r["workflow_moves"]))
    return t


def hf_table(workload: str, rows: list[dict]) -> Table:
    """The real engine's runs: wall-clock latencies, hits per tier, what was computed and loaded."""
    first = rows[0]
    t = Table(title=f"{workload} on {first.get('model')} (scale {first.get('scale')}): {first['workflows']} workflows; "
                    f"KV tokens device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                    f"disk {first['disk_tokens']:,}",
              caption="wall-clock s (idle tool waits skipped); hit: % of prompt tokens; computed: prompt tokens "
                      "prefilled; in host/disk: tokens loaded back; wall: whole run; xLRU: LRU latency / policy's")
    for col in ("conc", "policy", "lat", "TTFT", "dev", "host", "disk", "computed", "in host", "in disk",
                "wall", "xLRU"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["policy"], _fmt(r["mean_workflow_latency_s"]),
                  _fmt(r["mean_ttft_s"]), _fmt(r["device_hit_rate"], True), _fmt(r["host_hit_rate"], True),
                  _fmt(r["disk_hit_rate"], True), f"{r['computed_tokens']:,}", f"{r['loaded_host_tokens']:,}",
                  f"{r['loaded_disk_tokens']:,}", _fmt(r["wall_seconds"]),
                  f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-")
    return t


def vllm_table(workload: str, rows: list[dict]) -> Table:
    """vLLM runs: alone ("vllm") and with pbkv's connector (the other policies)."""
    first = rows[0]
    t = Table(title=f"{workload} on vLLM, {first.get('model')} (scale {first.get('scale')}): {first['workflows']} "
                    f"workflows; KV tokens vLLM {first['device_tokens']:,}, connector RAM "
                    f"{max(r['host_tokens'] for r in rows):,}, disk {max(r['disk_tokens'] for r in rows):,}",
              caption="vllm: vLLM alone, others: vLLM + pbkv connector with that policy; tokens: prompt, computed "
                      "(prefilled), hits in vLLM's prefix cache / connector RAM / disk; lat: wall-clock s per "
                      "workflow; wall: whole replay; xvLLM: vLLM-alone latency / setup's")
    for col in ("conc", "policy", "calls", "prompt", "computed", "vLLM hit", "RAM hit", "disk hit", "lat", "wall",
                "xvLLM"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["policy"], str(r["calls"]), f"{r['prompt_tokens']:,}",
                  f"{r['computed_tokens']:,}", f"{r['vllm_hit_tokens']:,}", f"{r['ram_hit_tokens']:,}",
                  f"{r['disk_hit_tokens']:,}", _fmt(r["mean_workflow_latency_s"]), _fmt(r["wall_seconds"]),
                  f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-")
    return t


def print_tables(records: list[dict], console: Console | None = None) -> None:
    console = console or Console()
    for t in tables(records):
        console.print(t)


def write_json(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def _label(r: dict) -> str:
    """A plot line: the policy, and the router when several instances ran."""
    return f"{r['policy']} / {r['router']}" if "router" in r else r["policy"]


def write_plots(records: list[dict], out: Path) -> list[Path]:
    """Per workload: speedup over LRU and device hit rate against concurrency, one line per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload and r["concurrency"] is not None]
        if not rows:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for label in dict.fromkeys(_label(r) for r in rows):
            pts = [r for r in rows if _label(r) == label]
            xs = [r["concurrency"] for r in pts]
            ax1.plot(xs, [r.get("speedup_vs_lru", 1.0) for r in pts], marker="o", label=label)
            ax2.plot(xs, [100 * r["device_hit_rate"] for r in pts], marker="o", label=label)
        ax1.set(title=f"{workload}: speedup over LRU", xlabel="concurrent workflows",
                ylabel="LRU mean workflow latency / policy's")
        ax2.set(title=f"{workload}: device hit rate", xlabel="concurrent workflows", ylabel="% of prompt tokens")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out / f"{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
