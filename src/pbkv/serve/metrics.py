"""`GET /metrics`: counters and gauges in the Prometheus text format (version 0.0.4).

Counters and histograms are updated from the event loop and from the engine thread, under one
lock. Figures that describe the engine (cache usage per tier, hit rates, evictions, predictor
accuracy, queue depth) are gathered on the engine thread when scraped (`gauges.py`: one
consistent snapshot between two engine steps) and passed to `render` as extra families.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]
Sample = tuple[dict, float]
Collector = Callable[[], Iterable[tuple[str, str, str, list[Sample]]]]

HELP = {
    "pbkv_requests_total": "HTTP requests answered, by endpoint and status code.",
    "pbkv_prompt_tokens_total": "Prompt tokens of served calls.",
    "pbkv_completion_tokens_total": "Generated tokens of served calls.",
    "pbkv_cancelled_requests_total": "Calls stopped because the client went away.",
    "pbkv_cache_hit_tokens_total": "Prompt tokens whose KV came from a cache tier, by tier.",
    "pbkv_cache_recomputed_tokens_total": "Prompt tokens computed by prefill (no cached KV).",
    "pbkv_workflows_started_total": "Workflow runs started (a call without a workflow id is a run of its own).",
    "pbkv_workflows_ended_total": "Workflow runs ended, by why: done, endpoint, idle, single (one call), shutdown.",
    "pbkv_request_latency_seconds": "Time from a call's arrival to its last token.",
    "pbkv_time_to_first_token_seconds": "Time from a call's arrival to its first token.",
}


def _key(labels: dict | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


def _fmt_labels(labels: Labels | dict) -> str:
    items = sorted(labels.items()) if isinstance(labels, dict) else labels
    if not items:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in items)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(items, esc)) + "}"


def _fmt_value(v: float) -> str:
    if v != v:
        return "NaN"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 2 ** 53 else repr(float(v))


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.counters: dict[str, dict[Labels, float]] = defaultdict(dict)
        self.hists: dict[str, tuple[list[int], list[float]]] = {}  # name -> (bucket counts, [sum, count])
        self.collectors: list[Collector] = []   # called on the scraping thread

    def inc(self, name: str, value: float = 1.0, labels: dict | None = None) -> None:
        key = _key(labels)
        with self._lock:
            row = self.counters[name]
            row[key] = row.get(key, 0.0) + value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            counts, total = self.hists.setdefault(name, ([0] * len(LATENCY_BUCKETS), [0.0, 0]))
            for i, b in enumerate(LATENCY_BUCKETS):
                if seconds <= b:
                    counts[i] += 1
            total[0] += seconds
            total[1] += 1

    def value(self, name: str, labels: dict | None = None) -> float:
        with self._lock:
            return self.counters.get(name, {}).get(_key(labels), 0.0)

    def render(self, extra: Iterable[tuple[str, str, str, list[Sample]]] = ()) -> str:
        """The exposition text: counters, histograms, then `extra` families (name, type, help,
        samples) and those of `collectors`."""
        lines: list[str] = []
        with self._lock:
            counters = {n: dict(r) for n, r in self.counters.items()}
            hists = {n: (list(c), list(t)) for n, (c, t) in self.hists.items()}
        for name in sorted(counters):
            lines += [f"# HELP {name} {HELP.get(name, name)}", f"# TYPE {name} counter"]
            lines += [f"{name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(counters[name].items())]
        for name in sorted(hists):
            counts, (total, n) = hists[name]
            lines += [f"# HELP {name} {HELP.get(name, name)}", f"# TYPE {name} histogram"]
            lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(LATENCY_BUCKETS, counts)]
            lines += [f'{name}_bucket{{le="+Inf"}} {n}', f"{name}_sum {_fmt_value(total)}", f"{name}_count {n}"]
        families = list(extra)
        for collect in self.collectors:
            families += list(collect())
        for name, kind, help_text, samples in families:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{_fmt_labels(labels)} {_fmt_value(v)}" for labels, v in samples]
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (for tests and the bench's summary)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
