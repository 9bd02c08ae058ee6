"""pbkv.trace.stats on tiny hand-built traces (hand-computed values) and on the chatdev dev trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pbkv.trace.call import Call, Trace, TraceMeta
from pbkv.trace.io import read_trace, validate
from pbkv.trace.stats import (END, MarkovPredictor, conditional_entropy, format_stats, markov_stats,
                              percentile_summary, prefix_reuse, trace_stats, transitions)

BS = 4
CHATDEV = Path(__file__).parents[2] / "shared/traces/chatdev-dev.jsonl"


def make_trace(workflows: dict[str, list], out_len: int = 1) -> Trace:
    """workflows: id -> list of agents (hash ids derived, unique per call) or of (agent, hash_ids)."""
    calls, next_id = [], 1000
    for wf, items in workflows.items():
        for step, item in enumerate(items):
            agent, ids = item if isinstance(item, tuple) else (item, None)
            if ids is None:
                ids, next_id = [next_id], next_id + 1
            calls.append(Call(workflow_id=wf, step=step, agent=agent, input_length=BS * len(ids),
                              output_length=out_len, hash_ids=list(ids)))
    trace = Trace(meta=TraceMeta(block_size=BS), calls=calls)
    validate(trace)
    return trace


def test_percentiles_median_and_nearest_rank_p90():
    assert percentile_summary(list(range(1, 11))) == {"median": 5.5, "p90": 9, "max": 10}
    assert percentile_summary(list(range(11, 0, -1))) == {"median": 6, "p90": 10, "max": 11}
    assert percentile_summary([3, 1, 2, 4]) == {"median": 2.5, "p90": 4, "max": 4}
    assert percentile_summary([5]) == {"median": 5, "p90": 5, "max": 5}
    assert percentile_summary([]) is None


def test_prefix_reuse_global_and_within_workflow():
    # file order puts b before a and steps reversed; stats order is workflow id, then step
    t = make_trace({"b": [("X", [1, 4]), ("X", [5])], "a": [("X", [1, 2]), ("X", [1, 2, 3])]})
    t.calls.reverse()
    # 8 blocks; global: a1 hits 1,2 and b0 hits 1 -> 3/8; within: only a1's 2 hits -> 2/8
    s = trace_stats(t)
    assert s["reuse_global"] == 0.375
    assert s["reuse_within_workflow"] == 0.25
    assert prefix_reuse([], within=False) is None


def test_prefix_reuse_counts_only_earlier_calls():
    # one call repeating an id inside itself is not a hit (only earlier calls fill the cache)
    c = Call(workflow_id="w", step=0, agent="A", input_length=8, output_length=0, hash_ids=[7, 7])
    assert prefix_reuse([[c]], within=False) == 0.0


def test_entropy_exactly_one_bit_and_end_variant():
    t = make_trace({"x": ["A", "B"], "y": ["A", "C"]})
    s = trace_stats(t)
    assert s["pairs"] == 2
    assert s["h_next"] == 1.0
    # +END: (A,B) (A,C) (B,END) (C,END): half the mass has H=1, the rest H=0
    assert s["h_next_end"] == 0.5
    assert conditional_entropy([("A", "A")] * 3) == 0.0
    assert conditional_entropy([]) is None


def test_counts_and_agent_order():
    t = make_trace({"w1": ["B", "A", "B"], "w2": ["C", "A"], "w3": ["C"]})
    s = trace_stats(t)
    assert (s["workflows"], s["calls"], s["agents"], s["pairs"]) == (3, 6, 3, 3)
    assert s["agent_calls"] == [["A", 2], ["B", 2], ["C", 2]]
    assert s["calls_per_workflow"] == {"median": 2, "p90": 3, "max": 3}
    assert s["input_length"] == {"median": 4, "p90": 4, "max": 4}


FIT = {"f1": ["A", "C"], "f2": ["A", "B"], "f3": ["B", "C"], "f4": ["D", "C"]}
TEST = {"h1": ["A", "B"], "h2": ["E", "C"], "h3": ["B", "C"], "h4": ["A", "C"], "h5": ["B", "B"]}


def test_markov_predictor_tie_by_name_and_unseen_fallback():
    m = MarkovPredictor(transitions([list(w) for w in FIT.values()], end=False))
    assert m.predict("A") == "B"  # A->B and A->C once each: tie broken by name
    assert m.predict("B") == "C"
    assert m.fallback == "C"  # successors overall: C 3, B 1
    assert m.predict("E") == "C"  # unseen agent -> most frequent successor overall


def test_markov_accuracy_baselines_and_end():
    m = markov_stats(make_trace(FIT), make_trace(TEST))
    # pairs: (A,B) ok, (E,C) unseen->C ok, (B,C) ok, (A,C) predicts B, (B,B) predicts C
    assert (m["pairs"], m["unseen"], m["top1"]) == (5, 1, 0.6)
    assert m["same"] == 0.2  # only (B,B)
    assert m["top"] == 0.6  # always C
    # +END fit: A->{B,C} tie -> B; B->{C,END} tie -> END (sorts first); C->END; D->C; overall END.
    # 10 test transitions, correct: (A,B) (B,END) (C,END)x3 (B,END) = 6
    assert END < "A"
    assert (m["calls"], m["top1_end"]) == (10, 0.6)


def test_single_call_workflows_give_none_and_na():
    t = make_trace({"a": ["chat"], "b": ["chat"]})
    s = trace_stats(t, heldout=t)
    assert s["pairs"] == 0 and s["h_next"] is None
    assert s["h_next_end"] == 0.0  # as STATS.md for mooncake: END is the only next value
    assert all(s["markov"][k] is None for k in ("top1", "top1_end", "same", "top", "unseen"))
    text = format_stats(s)
    assert "- H(next agent | current agent): n/a bits" in text
    assert "accuracy, fit on this trace, tested on heldout: n/a over 0 pairs" in text
    json.dumps(s)


def test_format_stats_lines():
    s = trace_stats(make_trace({"x": ["A", "B"], "y": ["A", "C"]}))
    text = format_stats(s)
    assert "- workflows 2, calls 4, consecutive agent pairs 2" in text
    assert "- agents (calls): A (2), B (1), C (1)" in text
    assert "- calls per workflow median/p90/max: 2 / 2 / 2" in text
    assert "bits (with end-of-workflow as a value: 0.500 bits)" in text
    assert "Markov" not in text  # no heldout given


def test_chatdev_dev_plausible():
    if not CHATDEV.exists():
        pytest.skip(f"{CHATDEV} not present")
    t = read_trace(CHATDEV)
    s = trace_stats(t, heldout=t)
    json.dumps(s)
    assert s["workload"] == "chatdev"
    assert s["workflows"] >= 20 and s["calls"] >= 300
    assert s["pairs"] == s["calls"] - s["workflows"]
    assert 5 <= s["agents"] <= 20 and s["agent_calls"][0][0] == "Programmer"
    assert 0.3 < s["reuse_within_workflow"] <= s["reuse_global"] < 0.6
    assert 0.9 < s["h_next"] < s["h_next_end"] < 1.6
    m = s["markov"]
    assert m["unseen"] == 0 and 0.4 < m["top1"] < 0.9 and 0.4 < m["top1_end"] < 0.9
    assert m["same"] < m["top1"] and m["top"] <= m["top1"]
    assert not math.isnan(m["top1"])
    assert s["calls_per_workflow"]["median"] <= s["calls_per_workflow"]["p90"] <= 50
    assert "- workflows" in format_stats(s)
