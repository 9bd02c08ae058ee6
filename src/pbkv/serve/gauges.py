"""What `/metrics` reads from the engine: one snapshot, taken on the engine thread between steps.

Hit rates are the share of served prompt tokens whose KV came from each tier (device includes
prefetched entries), the same definition as the simulator's reports (`pbkv.driver.metrics`).
"""

from __future__ import annotations

from pbkv.cache import Tier

TIERS = (("device", Tier.DEVICE), ("host", Tier.HOST), ("disk", Tier.DISK))


def _family(name: str, kind: str, help_text: str, samples) -> tuple:
    return (name, kind, help_text, [(labels, float(v)) for labels, v in samples])


def engine_snapshot(worker, metrics) -> list[tuple]:
    """Families (name, type, help, samples). Must run on the engine thread (`worker.call`)."""
    backend, table = worker.backend, worker.table
    cache, engine = backend.cache, backend.engine
    prompt = metrics.value("pbkv_prompt_tokens_total")
    hits = {t: metrics.value("pbkv_cache_hit_tokens_total", {"tier": t}) for t, _ in TIERS}
    out = [
        _family("pbkv_queue_depth", "gauge", "Requests waiting for admission (queued in the engine).",
                [({}, backend.queued())]),
        _family("pbkv_running_requests", "gauge", "Requests generating now.", [({}, backend.running())]),
        _family("pbkv_in_flight_requests", "gauge", "Requests submitted and not yet answered.",
                [({}, worker.in_flight)]),
        _family("pbkv_active_workflows", "gauge", "Workflow runs started and not yet ended.",
                [({}, len(table.live))]),
        _family("pbkv_cache_hit_rate", "gauge", "Share of served prompt tokens whose KV came from each tier.",
                [({"tier": t}, hits[t] / prompt if prompt else 0.0) for t, _ in TIERS]),
        _family("pbkv_cache_usage_tokens", "gauge", "Tokens of KV held in each tier.",
                [({"tier": t}, cache.usage[tier]) for t, tier in TIERS]),
        _family("pbkv_cache_capacity_tokens", "gauge", "Capacity of each tier in tokens (0: tier off).",
                [({"tier": t}, cache.capacity.of(tier)) for t, tier in TIERS]),
        _family("pbkv_cache_nodes", "gauge", "Radix-tree nodes in each tier.",
                [({"tier": t}, cache.nodes[tier]) for t, tier in TIERS]),
        _family("pbkv_cache_evictions_total", "counter", "Eviction passes of the cache.",
                [({}, cache.stats.evictions)]),
        _family("pbkv_cache_demoted_tokens_total", "counter", "Tokens evicted one tier down, by source tier.",
                [({"tier": t}, cache.stats.demoted[tier]) for t, tier in TIERS]),
        _family("pbkv_cache_dropped_tokens_total", "counter", "Tokens dropped from the cache, by tier.",
                [({"tier": t}, cache.stats.dropped[tier]) for t, tier in TIERS]),
        _family("pbkv_cache_loaded_tokens_total", "counter", "Tokens loaded up to the device, by source tier.",
                [({"tier": t}, cache.stats.loaded[tier]) for t, tier in TIERS]),
        _family("pbkv_prefetched_tokens_total", "counter", "Tokens the policy prefetched to the device.",
                [({}, engine.stats.prefetched_tokens)]),
        _family("pbkv_engine_seconds_total", "counter", "Seconds the engine spent, by phase.",
                [({"phase": "prefill"}, engine.stats.prefill_seconds),
                 ({"phase": "decode"}, engine.stats.decode_seconds),
                 ({"phase": "policy"}, engine.stats.policy_seconds)]),
    ]
    monitor = getattr(backend.policy, "monitor", None)
    if monitor is not None:
        out += [
            _family("pbkv_predictor_accuracy", "gauge", "Top-1 next-event accuracy of the predictor (rolling window).",
                    [({}, monitor.accuracy)]),
            _family("pbkv_predictor_baseline_accuracy", "gauge",
                    "Top-1 accuracy of the online Markov baseline (same window).", [({}, monitor.baseline_accuracy)]),
            _family("pbkv_predictor_trust", "gauge", "How far the policy trusts the predictor (1: fully, 0: LRU).",
                    [({}, monitor.trust)]),
            _family("pbkv_predictor_samples_total", "counter", "Predictions checked against what happened.",
                    [({}, monitor.total)]),
        ]
    learner = getattr(backend.policy, "learner", None)
    if learner is not None:
        out.append(_family("pbkv_predictor_retrains_total", "counter", "Online retrains of the predictor.",
                           [({}, learner.retrains)]))
    return out
