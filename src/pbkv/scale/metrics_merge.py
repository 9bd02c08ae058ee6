"""`/metrics` of `pbkv serve --replicas N`: the ingress's own families, then every replica's,
summed over replicas and per replica. No Ray here (unit-tested in the normal suite).

Layout of one merged family (Prometheus text format, written by `prometheus_client`):
- a sample without a `replica` label is the whole service, so dashboards written for one
  process keep working unchanged;
- the same sample with `replica="<id>"` is that replica's own value, for the replicas that
  answered this scrape only.
So `pbkv_x{replica=""}` selects the totals and `pbkv_x{replica!=""}` the replicas (summing both
counts twice).

Totals (`Merger` keeps what they need from one scrape to the next):
- counters and histograms (cumulative): the sum over every replica ever seen, each at its latest
  answer (`Merger`): a replica that died, was replaced (Ray gives the new one a new id) or did not answer in
  time still counts with its last known values. So a total never decreases while each replica's
  own counters do not (Prometheus would read a decrease as a counter reset);
- gauges: the sum over the replicas that answered (queue depth, usage, capacity are additive);
- ratios are not additive: the total of `pbkv_cache_hit_rate` is recomputed from the summed hit
  and prompt tokens, and the predictor's accuracies and trust are averaged over the answering
  replicas weighted by their `pbkv_predictor_samples_total` (a replica that has checked no
  prediction yet reports 0 accuracy, which says nothing).
Families the ingress owns (`INGRESS`: HTTP requests, latency, retries) come from the ingress
only (a replica serves no HTTP); the ingress's other families are dropped (its engine is remote).

Served tokens (`SERVED`: prompt, completion, hit per tier, recomputed): with `Merger(own_totals=
SERVED)` (the ingress does) their totals are the ingress's own counts, taken from the usage of
every answer a replica sent it (`pbkv.scale.remote`), so they hold every answered call, also one
whose replica died before any scrape (a replica's own counters reach the ingress only when
scraped). Their per-replica samples stay the replicas' own, so the per-replica samples of a
replica gone between scrapes need not add up to the total. Every other engine family (workflows,
cancellations, peer KV, the engine's gauges and histograms) is the replicas' own figure, merged as
above: such a total misses what a replica did after its last answered scrape.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA = "replica"
CUMULATIVE = {"counter", "histogram"}   # families whose every sample only grows during a replica's life
WEIGHTED = {"pbkv_predictor_accuracy", "pbkv_predictor_baseline_accuracy", "pbkv_predictor_trust"}
SAMPLES = "pbkv_predictor_samples_total"   # the weight of a replica's WEIGHTED figures
HIT_RATE = "pbkv_cache_hit_rate"
# families only the ingress counts (it serves HTTP, times answers and retries); its copies of the
# engine's families (zero: its engine is remote) are dropped, the replicas' are merged
INGRESS = {"pbkv_requests", "pbkv_request_latency_seconds", "pbkv_time_to_first_token_seconds",
           "pbkv_replica_retried_requests", "pbkv_replica_failed_requests"}
# families whose totals an ingress may count itself, from the answers' usage (see the docstring)
SERVED = frozenset({"pbkv_prompt_tokens", "pbkv_completion_tokens", "pbkv_cache_hit_tokens",
                    "pbkv_cache_recomputed_tokens"})


def _key(name: str, labels: Mapping[str, str]) -> tuple:
    return name, tuple(sorted(labels.items()))


def _sums(sample_lists: Iterable[Iterable[Sample]]) -> dict[tuple, float]:
    """Sample key -> the sum of its values, in the order keys first appear."""
    totals: dict[tuple, float] = {}
    for samples in sample_lists:
        for s in samples:
            k = _key(s.name, s.labels)
            totals[k] = totals.get(k, 0.0) + s.value
    return totals


def _weighted_means(answered: list[tuple[str, Metric]], weights: Mapping[str, float]) -> dict[tuple, float]:
    """Sample key -> the mean of its values weighted by each replica's weight; replicas weighing 0
    do not count, unless all do: then the plain mean (every replica reports the figure of one
    with no samples, so that is what one process with no samples would show)."""
    values: dict[tuple, list[tuple[float, float]]] = {}
    for replica, family in answered:
        for s in family.samples:
            values.setdefault(_key(s.name, s.labels), []).append((s.value, weights.get(replica, 0.0)))
    out = {}
    for k, pairs in values.items():
        weight = sum(w for _, w in pairs)
        out[k] = (sum(v * w for v, w in pairs) / weight if weight > 0
                  else sum(v for v, _ in pairs) / len(pairs))
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


def _sample_value(families: Iterable[Metric], name: str) -> float:
    """The unlabelled sample `name` of a replica's families, 0 when it has none."""
    return next((s.value for f in families for s in f.samples if s.name == name and not s.labels), 0.0)


class Merger:
    """Merges the ingress's and the replicas' /metrics texts, scrape after scrape, remembering
    every replica's cumulative samples by replica id (`last`): the highest value each reported,
    which is its latest (a replica's counters only grow) even when two concurrent scrapes finish
    out of order.

    Invariant: from one `merge` to the next, no total of a counter or histogram decreases as long
    as no replica's own value does (a replica that stops answering keeps its last values in the
    sums). `last` grows by one entry per replica ever seen: Ray replaces a lost replica, it does
    not add replicas without bound."""

    def __init__(self, own_totals: frozenset = frozenset()):
        self.own_totals = own_totals   # families whose totals are the ingress's own (`SERVED`)
        self.headers: dict[str, tuple] = {}   # cumulative family name -> (name, documentation, type, unit)
        self.last: dict[str, dict[str, dict[tuple, Sample]]] = {}   # replica id -> family -> sample key -> sample

    def merge(self, own: str, replicas: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
        """The merged exposition: `own`'s (the ingress's text) `INGRESS` families first, then
        `extra`, then the replicas' families (`replicas`: replica id -> its /metrics text, of the
        replicas that answered) merged as the module docstring says. Replicas are listed in id
        order, so the text is deterministic."""
        own_all = {f.name: f for f in text_string_to_metric_families(own)}
        own_families = [f for name, f in own_all.items() if name in INGRESS]
        counted = {name: own_all[name] for name in self.own_totals if name in own_all}
        answered: dict[str, list[tuple[str, Metric]]] = {}
        weights = {}
        for replica in sorted(replicas):
            families = [f for f in text_string_to_metric_families(replicas[replica]) if f.name not in INGRESS]
            weights[replica] = _sample_value(families, SAMPLES)
            for family in families:
                answered.setdefault(family.name, []).append((replica, family))
        self._remember(answered)
        names = list(answered) + [name for name in self.headers if name not in answered]
        names += [name for name in sorted(counted) if name not in names]
        merged = {name: self._family(name, answered.get(name, []), weights, counted.get(name)) for name in names}
        _recompute_hit_rate(merged)
        return generate_latest(_Families(own_families + list(extra) + list(merged.values())))

    def _remember(self, answered: dict[str, list[tuple[str, Metric]]]) -> None:
        for name, families in answered.items():
            for replica, family in families:
                if family.type in CUMULATIVE:
                    self.headers.setdefault(name, (family.name, family.documentation, family.type, family.unit))
                    known = self.last.setdefault(replica, {}).setdefault(name, {})
                    for sample in family.samples:
                        k = _key(sample.name, sample.labels)
                        if k not in known or sample.value > known[k].value:
                            known[k] = sample

    def _family(self, name: str, answered: list[tuple[str, Metric]], weights: Mapping[str, float],
                own: Metric | None = None) -> Metric:
        """One merged family: its totals first (`own`'s samples when the ingress counts them),
        then the answering replicas' own samples."""
        header = self.headers.get(name)
        if header is None:
            first = own if own is not None else answered[0][1]
            header = (first.name, first.documentation, first.type, first.unit)
        out = Metric(*header)
        if own is not None:
            totals = _sums([own.samples])
        elif header[2] in CUMULATIVE:
            totals = _sums(self.last[r][name].values() for r in sorted(self.last) if name in self.last[r])
        elif name in WEIGHTED:
            totals = _weighted_means(answered, weights)
        else:
            totals = _sums(family.samples for _, family in answered)
        for (sample, labels), value in totals.items():
            out.add_sample(sample, dict(labels), value)
        for replica, family in answered:
            for s in family.samples:
                out.add_sample(s.name, s.labels | {REPLICA: replica}, s.value)
        return out


class _Families:
    """A fixed list of families, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
