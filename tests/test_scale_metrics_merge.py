"""/metrics of `pbkv serve --replicas N` across scrapes (`pbkv.scale.metrics_merge.Merger`, no Ray):
counter totals never go down when a replica dies, is replaced or does not answer; per-replica
series and gauges come from the replicas that answered; the predictor's accuracies are weighted
by the samples each replica checked."""

from __future__ import annotations

import random

from pbkv.scale.metrics_merge import Merger
from pbkv.serve.metrics import Metrics, parse


def _replica(prompt: int = 0, queue: float = 0, latency: list[float] = (), accuracy: float | None = None,
             samples: int = 0) -> str:
    """A replica's /metrics text: its counters (prompt tokens, an engine histogram), a gauge and,
    when `accuracy` is given, the predictor's figures."""
    m = Metrics()
    if prompt:
        m.prompt_tokens.inc(prompt)
    for seconds in latency:
        m.latency.observe(seconds)
    text = m.exposition().decode().replace("pbkv_request_latency", "pbkv_engine_latency")
    text += f"# HELP pbkv_queue_depth q\n# TYPE pbkv_queue_depth gauge\npbkv_queue_depth {queue}\n"
    if accuracy is not None:
        text += (f"# HELP pbkv_predictor_accuracy a\n# TYPE pbkv_predictor_accuracy gauge\n"
                 f"pbkv_predictor_accuracy {accuracy}\n"
                 f"# HELP pbkv_predictor_baseline_accuracy b\n# TYPE pbkv_predictor_baseline_accuracy gauge\n"
                 f"pbkv_predictor_baseline_accuracy {accuracy / 2}\n"
                 f"# HELP pbkv_predictor_samples_total s\n# TYPE pbkv_predictor_samples_total counter\n"
                 f"pbkv_predictor_samples_total {samples}\n")
    return text


def test_predictor_accuracy_is_weighted_by_each_replicas_samples():
    fresh = _replica(accuracy=0.0, samples=0)          # a replica that has checked nothing reports 0
    got = parse(Merger().merge("", {"a": _replica(accuracy=0.8, samples=1000), "b": fresh}).decode())
    assert got["pbkv_predictor_accuracy"] == 0.8 and got["pbkv_predictor_baseline_accuracy"] == 0.4
    assert got['pbkv_predictor_accuracy{replica="b"}'] == 0.0            # each replica's own figure stays
    busy = {"a": _replica(accuracy=0.9, samples=300), "b": _replica(accuracy=0.5, samples=100)}
    got = parse(Merger().merge("", busy).decode())
    assert abs(got["pbkv_predictor_accuracy"] - (0.9 * 300 + 0.5 * 100) / 400) < 1e-12
    got = parse(Merger().merge("", {"a": fresh, "b": fresh}).decode())          # nobody has samples: as one replica
    assert got["pbkv_predictor_accuracy"] == 0.0


def test_counter_totals_keep_a_replaced_replicas_last_values():
    merger = Merger()
    first = parse(merger.merge("", {"a": _replica(100, queue=2, latency=[0.1]),
                                    "b": _replica(50, queue=3, latency=[0.2, 0.3])}).decode())
    assert first["pbkv_prompt_tokens_total"] == 150 and first["pbkv_engine_latency_seconds_count"] == 3
    # b died; Ray replaced it with c (a new id, counting from zero)
    second = parse(merger.merge("", {"a": _replica(110, queue=1, latency=[0.1, 0.4]),
                                     "c": _replica(5, queue=4)}).decode())
    assert second["pbkv_prompt_tokens_total"] == 110 + 50 + 5                  # not 115: b's 50 still count
    assert second["pbkv_engine_latency_seconds_count"] == 4                    # histograms too
    assert second['pbkv_engine_latency_seconds_bucket{le="0.5"}'] == 4
    assert {k for k in second if k.startswith("pbkv_prompt_tokens_total{")} == {
        'pbkv_prompt_tokens_total{replica="a"}', 'pbkv_prompt_tokens_total{replica="c"}'}   # who answered
    assert second["pbkv_queue_depth"] == 5                               # gauges: the answering replicas only


def test_a_replica_that_does_not_answer_keeps_counting_with_its_last_values():
    merger = Merger()
    merger.merge("", {"a": _replica(100), "b": _replica(50, queue=3)})
    frozen = parse(merger.merge("", {"a": _replica(120)}).decode())
    assert frozen["pbkv_prompt_tokens_total"] == 170 and frozen["pbkv_queue_depth"] == 0
    back = parse(merger.merge("", {"a": _replica(120), "b": _replica(80)}).decode())
    assert back["pbkv_prompt_tokens_total"] == 200                     # b's new value replaces its old one


def test_with_no_replica_answering_the_counters_stay_and_the_gauges_go():
    merger = Merger()
    ingress = Metrics()
    ingress.requests.labels(endpoint="/metrics", status="200").inc()
    merger.merge(ingress.exposition().decode(), {"a": _replica(100, queue=2), "b": _replica(50)})
    got = parse(merger.merge(ingress.exposition().decode(), {}).decode())
    assert got["pbkv_prompt_tokens_total"] == 150
    assert got['pbkv_requests_total{endpoint="/metrics",status="200"}'] == 1
    assert "pbkv_queue_depth" not in got and not any("replica=" in k for k in got)


def test_totals_never_decrease_over_random_deaths_freezes_and_replacements():
    rng = random.Random(7)
    merger, alive, counts, reported, last_total, next_id = Merger(), ["r0", "r1", "r2"], {}, {}, 0.0, 3
    for _ in range(200):
        for r in alive:
            counts[r] = counts.get(r, 0) + rng.randrange(5)   # each replica's own counter only grows
        if rng.random() < 0.2:                                   # one dies, a fresh one replaces it
            alive[rng.randrange(len(alive))] = f"r{next_id}"
            next_id += 1
        answering = [r for r in alive if rng.random() < 0.7]     # the others are slow or restarting
        reported.update({r: counts.get(r, 0) for r in answering})
        got = parse(merger.merge("", {r: _replica(counts.get(r, 0)) for r in answering}).decode())
        total = got.get("pbkv_prompt_tokens_total", 0.0)
        assert total >= last_total and total == sum(reported.values())
        last_total = total


def test_an_older_scrape_finishing_last_does_not_take_the_totals_back():
    merger = Merger()
    merger.merge("", {"a": _replica(110)})      # the later scrape (a at 110) finished first
    late = parse(merger.merge("", {"a": _replica(100)}).decode())   # one begun earlier, a frozen replica held it
    assert late["pbkv_prompt_tokens_total"] == 110 and late['pbkv_prompt_tokens_total{replica="a"}'] == 100
