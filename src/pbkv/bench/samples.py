"""Several samples of one benchmark cell at slightly larger memories, averaged (`--samples N`).

Why: a simulated replay is deterministic but chaotic. A closed-loop replay's latency depends on
which requests happen to share decode batches and when each is admitted, and a capacity a few
tokens larger reorders that; on a real trace a device 0.07% larger moved one policy's mean
workflow latency by 1.3% while its hit rate moved by less than 0.01 (chatdev, device+host,
16 lanes: pbkv 0.987x LRU at 16,467 device tokens, 1.005x at 16,479). One run cannot tell a
1% latency difference from that noise; the mean of several can, and the spread says how wide
the noise is.

Sample i runs with every tier's capacity (the shared tier's too) scaled by `factor(i)` =
1 + i x STEP, so sample 0 is the nominal run (N = 1 is exactly the single run) and no sample
drops below a regime's clamp (the largest call). The averaged record keeps the nominal capacities and gains `samples` and
the per-sample range of its speedup over LRU (`speedup_vs_lru_min` / `_max`);
`speedup_vs_lru` itself is the ratio of the mean latencies (`sweep.finish_records`). Behind
several routers each router has its own LRU, so a record also gets the per-sample range of the
best other router's latency over its own (`vs_best_router_min` / `_max`: above 1 in every
sample means this router was the fastest in every sample).
"""

from __future__ import annotations

from dataclasses import replace

STEP = 0.005       # 0.5% more memory per sample: far above the noise's scale (a few tokens), far
                   # below the steps between regimes (2x and more)
SAMPLE_KEY = "_sample"
NOMINAL = ("device_tokens", "host_tokens", "disk_tokens", "shared_tier_tokens", "pressure")


def factor(i: int) -> float:
    """How much larger sample `i`'s tiers are than the nominal ones."""
    return 1.0 + STEP * i


def tokens(nominal: int, i: int) -> int:
    """Sample `i`'s size of a tier of `nominal` tokens (rounded: 6000 x 1.005 is 6029.99...)."""
    return nominal if i == 0 else round(nominal * factor(i))


def scaled(run, i: int):
    """`run` (a RunConfig) with every resolved tier capacity scaled by `factor(i)`; sample 0
    unchanged. The shared tier of several instances scales alike (`tokens`, in `bench.sweep`)."""
    if i == 0:
        return run
    caps = run.capacities()
    cache = replace(run.cache, device_tokens=tokens(caps.device, i), host_tokens=tokens(caps.host, i),
                    disk_tokens=tokens(caps.disk, i))
    return replace(run, cache=cache)


def average(records: list[dict], cell) -> list[dict]:
    """One record per (cell, policy), in first-seen order: the mean of each number over the
    samples (integers rounded), the nominal (sample 0) capacities, `samples`, and the range of
    the per-sample speedups over LRU (LRU of the same cell and sample). Records without a
    sample index pass through."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((cell(r), r["policy"]), []).append(r)
    lru = {(cell(r), r.get(SAMPLE_KEY)): r for r in records if r["policy"] == "lru"}
    routers = _by_router(records, cell)
    out = []
    for (key, policy), rows in groups.items():
        if len(rows) == 1 and SAMPLE_KEY not in rows[0]:
            out.append(rows[0])
            continue
        rows = sorted(rows, key=lambda r: r[SAMPLE_KEY])
        merged = _mean(rows)
        merged["samples"] = len(rows)
        if policy != "lru":
            ups = [lru[(key, r[SAMPLE_KEY])]["mean_workflow_latency_s"] / max(r["mean_workflow_latency_s"], 1e-12)
                   for r in rows if (key, r[SAMPLE_KEY]) in lru]
            if ups:
                merged["speedup_vs_lru_min"], merged["speedup_vs_lru_max"] = min(ups), max(ups)
        if "router" in rows[0]:
            vs = _vs_best_router(routers, cell, rows)
            if vs:
                merged["vs_best_router_min"], merged["vs_best_router_max"] = min(vs), max(vs)
        out.append(merged)
    return out


def _by_router(records: list[dict], cell) -> dict[tuple, dict[str, float]]:
    """(cell without its router, policy, sample) -> router -> mean workflow latency, for the
    records behind a router (`cell(r)` ends with the router)."""
    out: dict[tuple, dict[str, float]] = {}
    for r in records:
        if r.get("router") is not None:
            out.setdefault((cell(r)[:-1], r["policy"], r[SAMPLE_KEY]), {})[r["router"]] = r["mean_workflow_latency_s"]
    return out


def _vs_best_router(routers: dict, cell, rows: list[dict]) -> list[float]:
    """Per sample of `rows` (one router's runs): the fastest other router's latency over this
    one's, same workload, clients, regime, instances, policy and sample."""
    out = []
    for r in rows:
        others = [lat for name, lat in routers[(cell(r)[:-1], r["policy"], r[SAMPLE_KEY])].items()
                  if name != r["router"]]
        if others:
            out.append(min(others) / max(r["mean_workflow_latency_s"], 1e-12))
    return out


def _mean(rows: list[dict]) -> dict:
    first = rows[0]
    merged = {}
    for k, v in first.items():
        if k == SAMPLE_KEY:
            continue
        values = [r.get(k) for r in rows]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)
        if k in NOMINAL or not numeric:
            merged[k] = v
        elif all(isinstance(x, int) for x in values):
            merged[k] = round(sum(values) / len(values))
        else:
            merged[k] = sum(values) / len(values)
    return merged
