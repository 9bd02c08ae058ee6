"""`GET /metrics`: this server's counters and histograms, exposed by `prometheus_client`.

Each server has its own `CollectorRegistry` (never the process-wide default), so two servers in
one process (the tests) neither share nor collide. The metrics are updated from the event loop
and from the engine thread (prometheus_client's metrics are thread-safe). Figures that describe
the engine (cache usage per tier, hit rates, evictions, predictor accuracy, queue depth) are
gathered on the engine thread when scraped (`gauges.py`: one consistent snapshot between two
engine steps) and exposed after the registry's own families (`exposition`).
Exposed names are the attribute's metric name as written here, `_total` included; no `_created`
series are written.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric

from pbkv.engine.request import HIT_TIERS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"   # the text format `generate_latest` writes
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIERS = HIT_TIERS   # where a prompt's KV came from: the local tiers and the shared directory


class Metrics:
    """The counters and histograms of one server (the engine's figures: `gauges.py`)."""

    def __init__(self):
        disable_created_metrics()  # a process-wide switch of the library: no `<name>_created` samples
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pbkv_requests_total", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pbkv_prompt_tokens_total", "Prompt tokens of served calls.", registry=r)
        self.completion_tokens = Counter("pbkv_completion_tokens_total", "Generated tokens of served calls.",
                                         registry=r)
        self.cancelled = Counter("pbkv_cancelled_requests_total", "Calls stopped because the client went away.",
                                 registry=r)
        self.hit_tokens = Counter("pbkv_cache_hit_tokens_total",
                                  "Prompt tokens whose KV came from a cache tier, by tier.", ["tier"], registry=r)
        self.recomputed_tokens = Counter("pbkv_cache_recomputed_tokens_total",
                                         "Prompt tokens computed by prefill (no cached KV).", registry=r)
        self.workflows_started = Counter(
            "pbkv_workflows_started_total",
            "Workflow runs started (a call without a workflow id is a run of its own).", registry=r)
        self.workflows_ended = Counter(
            "pbkv_workflows_ended_total",
            "Workflow runs ended, by why: done, endpoint, idle, single (one call), shutdown.", ["reason"], registry=r)
        self.record_errors = Counter(
            "pbkv_record_errors_total", "Workflow runs --record could not write (disk full, folder gone: see "
            "the log); serving goes on.", registry=r)
        self.latency = Histogram("pbkv_request_latency_seconds", "Time from a call's arrival to its last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("pbkv_time_to_first_token_seconds",
                                     "Time from a call's arrival to its first token.", buckets=LATENCY_BUCKETS,
                                     registry=r)

    def served(self, prompt_tokens: int, completion_tokens: int, hits: dict[str, int], recomputed: int,
               cancelled: bool) -> None:
        """Count one ended call; `hits`: prompt tokens per tier whose KV was cached."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        for tier in TIERS:
            self.hit_tokens.labels(tier=tier).inc(hits.get(tier, 0))
        self.recomputed_tokens.inc(recomputed)
        if cancelled:
            self.cancelled.inc()

    def hit_rates(self) -> dict[str, float]:
        """Share of served prompt tokens whose KV came from each tier (0 before any call)."""
        prompt = _value(self.prompt_tokens)
        return {t: _value(self.hit_tokens, tier=t) / prompt if prompt else 0.0 for t in TIERS}

    def exposition(self, extra: Iterable[Metric] = ()) -> bytes:
        """The text format: this registry's families, then `extra` (the engine's snapshot)."""
        return generate_latest(_Joined(self.registry, list(extra)))


class _Joined:
    """A registry followed by families built elsewhere: what `generate_latest` reads."""

    def __init__(self, registry: CollectorRegistry, extra: list[Metric]):
        self.registry, self.extra = registry, extra

    def collect(self) -> Iterable[Metric]:
        yield from self.registry.collect()
        yield from self.extra


def _value(metric, **labels) -> float:
    """The current value of a counter (of the child with `labels`); 0 when it has none yet."""
    child = metric.labels(**labels) if labels else metric
    for family in child.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return sample.value
    return 0.0


def parse(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (for tests and the examples' summaries)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
