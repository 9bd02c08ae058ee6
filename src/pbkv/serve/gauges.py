"""What `/metrics` reads from the engine: one snapshot, taken on the engine thread between steps.

Hit rates are the share of served prompt tokens whose KV came from each tier (device includes
prefetched entries), the same definition as the simulator's reports (`pbkv.driver.metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pbkv.cache import Tier
from pbkv.engine.request import SHARED

if TYPE_CHECKING:
    from pbkv.engine.hf import HFEngine

TIERS = (("device", Tier.DEVICE), ("host", Tier.HOST), ("disk", Tier.DISK))


def _family(kind, name: str, help_text: str, samples: list[tuple[dict, float]]) -> Metric:
    """A gauge or counter family (`kind`) from (labels, value) samples that share their label names."""
    family = kind(name, help_text, labels=list(samples[0][0]))
    for labels, value in samples:
        family.add_metric(list(labels.values()), float(value))
    return family


def _one(kind, name: str, help_text: str, value: float) -> Metric:
    return _family(kind, name, help_text, [({}, value)])


def _per_tier(kind, name: str, help_text: str, values) -> Metric:
    return _family(kind, name, help_text, [({"tier": t}, values[tier]) for t, tier in TIERS])


def engine_snapshot(engine: HFEngine, in_flight: int, active_workflows: int,
                    hit_rates: dict[str, float]) -> list[Metric]:
    """The engine's families. Must run on the engine thread (`EngineWorker.call`)."""
    engine.drop_failed_writes()   # an idle server takes no step: usage counts only KV that exists
    cache, stats = engine.cache, engine.stats
    out = [
        _one(GaugeMetricFamily, "pbkv_queue_depth", "Requests waiting for admission (queued in the engine).",
             engine.queue_depth),
        _one(GaugeMetricFamily, "pbkv_running_requests", "Requests generating now.", engine.running_count),
        _one(GaugeMetricFamily, "pbkv_in_flight_requests", "Requests submitted and not yet answered.", in_flight),
        _one(GaugeMetricFamily, "pbkv_active_workflows", "Workflow runs started and not yet ended.",
             active_workflows),
        _family(GaugeMetricFamily, "pbkv_cache_hit_rate", "Share of served prompt tokens whose KV came from each tier.",
                [({"tier": t}, rate) for t, rate in hit_rates.items()]),
        _per_tier(GaugeMetricFamily, "pbkv_cache_usage_tokens", "Tokens of KV held in each tier.", cache.usage),
        _family(GaugeMetricFamily, "pbkv_cache_capacity_tokens", "Capacity of each tier in tokens (0: tier off).",
                [({"tier": t}, cache.capacity.of(tier)) for t, tier in TIERS]),
        _per_tier(GaugeMetricFamily, "pbkv_cache_nodes", "Radix-tree nodes in each tier.", cache.nodes),
        _one(CounterMetricFamily, "pbkv_cache_evictions_total", "Eviction passes of the cache.",
             cache.stats.evictions),
        _per_tier(CounterMetricFamily, "pbkv_cache_demoted_tokens_total",
                  "Tokens evicted one tier down, by source tier.", cache.stats.demoted),
        _per_tier(CounterMetricFamily, "pbkv_cache_dropped_tokens_total", "Tokens dropped from the cache, by tier.",
                  cache.stats.dropped),
        _family(CounterMetricFamily, "pbkv_cache_loaded_tokens_total",
                "Tokens loaded up to the device, by source tier (shared: the directory shared with other engines).",
                [({"tier": t}, cache.stats.loaded[tier]) for t, tier in TIERS]
                + [({"tier": "shared"}, stats.loaded_tokens[SHARED])]),
        _one(CounterMetricFamily, "pbkv_disk_write_errors_total", "Disk-tier writes that failed (their KV is "
             "lost, recomputed when needed; see the log).", engine.store.stats.write_errors),
        _one(CounterMetricFamily, "pbkv_disk_corrupt_total", "Disk-tier reads refused by a check (checksum, "
             "truncation, missing file; their tokens recomputed).", engine.store.stats.corrupt),
        _one(CounterMetricFamily, "pbkv_prefetched_tokens_total", "Tokens the policy prefetched to the device.",
             stats.prefetched_tokens),
        _one(CounterMetricFamily, "pbkv_policy_fallbacks_total", "Times a policy hook raised and the cache "
             "policy was replaced by LRU (see the log).", stats.policy_fallbacks),
        _family(CounterMetricFamily, "pbkv_engine_seconds_total", "Seconds the engine spent, by phase.",
                [({"phase": "prefill"}, stats.prefill_seconds), ({"phase": "decode"}, stats.decode_seconds),
                 ({"phase": "policy"}, stats.policy_seconds)]),
    ]
    return out + _shared(engine) + _predictor(engine.policy)


def _shared(engine) -> list[Metric]:
    """KV moved between replicas (`peer.py`), and the shared directory's counters (none without one)."""
    peer = getattr(engine, "peer", None)
    pc = peer.counters if peer is not None else None
    out = [] if pc is None else [
        _one(CounterMetricFamily, "pbkv_peer_kv_blocks_received_total", "KV blocks other replicas sent this engine "
             "for calls routed here (read as tier shared).", pc.blocks_received),
        _one(CounterMetricFamily, "pbkv_peer_kv_blocks_read_total", "Received blocks a call read.", pc.blocks_read),
        _one(CounterMetricFamily, "pbkv_peer_kv_blocks_sent_total", "KV blocks this engine sent to other replicas.",
             pc.blocks_sent),
        _one(CounterMetricFamily, "pbkv_peer_kv_blocks_unused_total", "Received blocks dropped unread.",
             pc.blocks_unused),
    ]
    sh = engine.shared
    if sh is None:
        return out
    st = sh.dir.stats
    return out + [
        _one(CounterMetricFamily, "pbkv_shared_kv_files_written_total", "KV blocks this engine wrote to the shared "
             "directory.", sh.counters.blocks_written),
        _one(CounterMetricFamily, "pbkv_shared_kv_corrupt_total", "Shared-directory files refused by a check "
             "(removed, their tokens recomputed).", st.corrupt),
        _one(CounterMetricFamily, "pbkv_shared_kv_write_errors_total", "Shared-directory writes that failed.",
             sh.counters.write_errors),
    ]


def _predictor(policy) -> list[Metric]:
    """The predictor's quality figures, for policies that predict (and learn online)."""
    out = []
    monitor = getattr(policy, "monitor", None)
    if monitor is not None:
        out += [
            _one(GaugeMetricFamily, "pbkv_predictor_accuracy",
                 "Top-1 next-event accuracy of the predictor (rolling window).", monitor.accuracy),
            _one(GaugeMetricFamily, "pbkv_predictor_baseline_accuracy",
                 "Top-1 accuracy of the online Markov baseline (same window).", monitor.baseline_accuracy),
            _one(GaugeMetricFamily, "pbkv_predictor_trust",
                 "How far the policy trusts the predictor (1: fully, 0: LRU).", monitor.trust),
            _one(CounterMetricFamily, "pbkv_predictor_samples_total", "Predictions checked against what happened.",
                 monitor.total),
        ]
    learner = getattr(policy, "learner", None)
    if learner is not None:
        out.append(_one(CounterMetricFamily, "pbkv_predictor_retrains_total", "Online retrains of the predictor.",
                        learner.retrains))
        out.append(_one(CounterMetricFamily, "pbkv_predictor_retrains_dropped_total",
                        "Retrains not used: trained on fewer workflows than the loaded predictor, or failed.",
                        getattr(learner, "dropped", 0)))
    return out
