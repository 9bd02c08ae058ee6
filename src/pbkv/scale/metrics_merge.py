"""`/metrics` of `pbkv serve --replicas N`: the ingress's own families, then every replica's,
summed over replicas and per replica. No Ray here (unit-tested in the normal suite).

Layout of one merged family (Prometheus text format, written by `prometheus_client`):
- a sample without a `replica` label is the whole service: the sum over the replicas that
  answered, so dashboards written for one process keep working unchanged;
- the same sample with `replica="<id>"` is that replica's own value.
So `pbkv_x{replica=""}` selects the totals and `pbkv_x{replica!=""}` the replicas (summing both
counts twice). Sums are right for counters, histograms and additive gauges (queue depth, usage,
capacity); ratios are not, so the total of `pbkv_cache_hit_rate` is recomputed from the summed
hit and prompt tokens, and the predictor's accuracies and trust are averaged over replicas.
Families the ingress owns (`INGRESS`: HTTP requests, latency, retries) come from the ingress
only (a replica serves no HTTP); the ingress's other families are dropped (its engine is remote).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA = "replica"
MEANS = {"pbkv_predictor_accuracy", "pbkv_predictor_baseline_accuracy", "pbkv_predictor_trust"}
HIT_RATE = "pbkv_cache_hit_rate"
# families only the ingress counts (it serves HTTP, times answers and retries); its copies of the
# engine's families (zero: its engine is remote) are dropped, the replicas' are merged
INGRESS = {"pbkv_requests", "pbkv_request_latency_seconds", "pbkv_time_to_first_token_seconds",
           "pbkv_replica_retried_requests", "pbkv_replica_failed_requests"}


def _key(name: str, labels: Mapping[str, str]) -> tuple:
    return name, tuple(sorted(labels.items()))


def _merge_family(families: list[tuple[str, Metric]]) -> Metric:
    """One family from each replica -> totals first, then per-replica samples."""
    first = families[0][1]
    out = Metric(first.name, first.documentation, first.type, first.unit)
    totals: dict[tuple, float] = {}
    counts: dict[tuple, int] = {}
    for _, family in families:
        for s in family.samples:
            k = _key(s.name, s.labels)
            totals[k] = totals.get(k, 0.0) + s.value
            counts[k] = counts.get(k, 0) + 1
    for (name, labels), value in totals.items():
        if first.name in MEANS:
            value /= counts[(name, labels)]
        out.add_sample(name, dict(labels), value)
    for replica, family in families:
        for s in family.samples:
            out.add_sample(s.name, s.labels | {REPLICA: replica}, s.value)
    return out


def _recompute_hit_rate(merged: dict[str, Metric]) -> None:
    """The total hit rate per tier = summed hit tokens / summed prompt tokens (not a sum of rates)."""
    rate, hits, prompt = merged.get(HIT_RATE), merged.get("pbkv_cache_hit_tokens"), merged.get("pbkv_prompt_tokens")
    if rate is None or hits is None or prompt is None:
        return
    total_prompt = sum(s.value for s in prompt.samples if REPLICA not in s.labels)
    tier_hits = {s.labels.get("tier"): s.value for s in hits.samples if REPLICA not in s.labels}
    for i, s in enumerate(rate.samples):
        if REPLICA not in s.labels:
            value = tier_hits.get(s.labels.get("tier"), 0.0) / total_prompt if total_prompt else 0.0
            rate.samples[i] = s._replace(value=value)


def merge(own: str, replicas: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """The merged exposition: `own`'s (the ingress's text) `INGRESS` families first, then
    `extra`, then the replicas' families (`replicas`: replica id -> its /metrics text) merged as
    the module docstring says. Replicas are listed in id order, so the text is deterministic."""
    own_families = [f for f in text_string_to_metric_families(own) if f.name in INGRESS]
    by_name: dict[str, list[tuple[str, Metric]]] = {}
    for replica in sorted(replicas):
        for family in text_string_to_metric_families(replicas[replica]):
            if family.name not in INGRESS:
                by_name.setdefault(family.name, []).append((replica, family))
    merged = {name: _merge_family(fams) for name, fams in by_name.items()}
    _recompute_hit_rate(merged)
    return generate_latest(_Families(own_families + list(extra) + list(merged.values())))


class _Families:
    """A fixed list of families, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
