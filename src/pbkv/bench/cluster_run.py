"""A simulated run on N engine instances behind a router (`pbkv bench --instances N --router R`).

Each instance is a `Simulator` with its own `TieredCache` (the run's capacities, per instance)
and its own policy object, built exactly as a one-instance run builds them
(`runner.build_policy`); `pbkv.scale.cluster.Cluster` routes every call and moves KV over the
instance-to-instance link. `--concurrency` counts clients of the whole cluster, so a record with
N instances compares with the one-instance record at the same concurrency.
"""

from __future__ import annotations

from pbkv.bench.run import RunConfig, SimSetup, Workload
from pbkv.bench.runner import build_policy, check_fits
from pbkv.cache import RadixTree, Tier, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.engine.cost import CostModel
from pbkv.engine.simulator import Simulator
from pbkv.route import RouterConfig, make_router
from pbkv.scale.cluster import Cluster, SharedTier
from pbkv.scale.links import Link, get_link


def router_config(cost: CostModel, workload: Workload, link: Link, gpus: int, batch: int = 16) -> RouterConfig:
    """A router's costs from the profile: prefill seconds per token at a typical prompt, the link's
    seconds per token, and the wait one queued request adds: one engine iteration, i.e. a decode
    step of `batch` running requests at the typical prompt (a continuously batching engine admits
    waiting requests at iteration boundaries, FCFS, so each request ahead holds a newcomer back by
    about one iteration; a request blocked for memory waits longer, but then so does every
    replica's queue alike). This replaced a share of a prefill chosen on hover and swe
    (`QUEUE_SHARE` = 0.05): the step is 0.045 s on a6000-qwen3-32b where the share gave 0.03 s
    (hover) and 0.08 s (swe)."""
    calls = [c for w in workload.workflows for c in w]
    mean_prompt = max(1, sum(c.input_length for c in calls) // max(1, len(calls)))
    per_token = cost.prefill_seconds(cost.prefill_flops(mean_prompt, 0)) / mean_prompt
    batch = max(1, batch)
    return RouterConfig(prefill_s_per_token=per_token,
                        transfer_s_per_token=link.seconds(cost.kv_bytes * 1e6, gpus) / 1e6,
                        transfer_latency_s=link.latency_s,
                        queue_s_per_request=cost.decode_step_seconds(batch, batch * mean_prompt),
                        block_size=workload.trace.block_size)


def simulate_cluster(workload: Workload, cfg: RunConfig, instances: int, router: str, link: Link,
                     progress=None, shared_tokens: int = 0, shared_link: Link | None = None) -> dict:
    """Replay `workload` on `instances` simulated instances; the one-instance record's fields
    (summed over instances) plus `instances`, `router`, `bytes_moved_between_instances`, and with
    `shared_tokens` > 0 a shared KV tier of that many tokens read over `shared_link`."""
    cost = CostModel(cfg.profile)
    setup = SimSetup(cost, cfg.concurrency)
    caps = setup.capacities(workload, cfg)
    check_fits(workload, caps.device)
    engines = []
    for _ in range(instances):
        policy = build_policy(workload, cfg, setup)
        engines.append(Simulator(cost, TieredCache(RadixTree(workload.trace.block_size), caps, policy), policy))
    gpus = cfg.profile.gpu.count
    shared = SharedTier(shared_tokens, shared_link or get_link("nvme"), workload.trace.block_size) \
        if shared_tokens > 0 else None
    batch = -(-(cfg.concurrency or 16) // instances)   # clients per instance (open loop: 16, as the oracle's schedule)
    cluster = Cluster(engines, make_router(router, router_config(cost, workload, link, gpus, batch)), link,
                      cost.kv_bytes, gpus, shared)
    record = Replay(cluster, workload.workflows, cfg.concurrency, Recorder(), progress).run().summary()
    caches = [e.cache for e in engines]
    stats = [e.stats for e in engines]
    record.update({
        "bytes_loaded": cost.kv_bytes * sum(c.stats.loaded[Tier.HOST] + c.stats.loaded[Tier.DISK] for c in caches),
        "bytes_offloaded": cost.kv_bytes * sum(c.stats.demoted[Tier.DEVICE] for c in caches),
        "prefetched_tokens": sum(s.prefetched_tokens for s in stats),
        "evictions": sum(c.stats.evictions for c in caches),
        "device_tokens": caps.device, "host_tokens": caps.host, "disk_tokens": caps.disk,
        "prefill_seconds": sum(s.prefill_seconds for s in stats),
        "decode_seconds": sum(s.decode_seconds for s in stats),
        "decode_steps": sum(s.decode_steps for s in stats),
        "policy_seconds": sum(s.policy_seconds for s in stats),
        "policy_overhead": sum(s.policy_seconds for s in stats) / max(record["makespan_s"], 1e-9),
        "instances": instances, "router": router, "link": link.name,
        "bytes_moved_between_instances": cluster.stats.bytes_moved,
        "kv_fetches": cluster.stats.fetches, "kv_fetch_failed": cluster.stats.fetch_failed, "workflow_moves": cluster.stats.moves,
        "max_instance_share": max(cluster.stats.calls) / max(1, sum(cluster.stats.calls)),
    })
    record.update(monitor_summary([getattr(e.policy, "monitor", None) for e in engines]))
    if shared is not None:
        record.update({"shared_tier_tokens": shared_tokens, "shared_tier_reads": cluster.stats.shared_reads,
                       "shared_tier_reads_failed": cluster.stats.shared_read_failed,
                       "bytes_from_shared_tier": cluster.stats.bytes_from_shared,
                       "bytes_to_shared_tier": cluster.stats.bytes_to_shared})
    return record


def monitor_summary(monitors: list) -> dict:
    """The instances' predictor-monitor readings as one run's (`PredictionMonitor.summary`): one
    instance's as they are, so one instance behind a router reproduces the plain record; several
    instances' readings averaged by their samples (`monitor_samples` summed), `retired_reuse`
    by instance."""
    summaries = [m.summary() for m in monitors if m is not None]
    if len(summaries) <= 1:
        return summaries[0] if summaries else {}
    out = {"retired_reuse": sum(s["retired_reuse"] for s in summaries) / len(summaries)}
    sampled = [s for s in summaries if s.get("monitor_samples")]
    total = sum(s["monitor_samples"] for s in sampled)
    if total:
        out["monitor_samples"] = total
        for key in sampled[0]:
            if key not in out:
                out[key] = sum(s[key] * s["monitor_samples"] for s in sampled) / total
    return out
