"""pbkv.trace.stats on tiny hand-built traces and on the fixtures of tests/data (hand-computed values;
the definitions are in docs/trace-format.md, "Statistics")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


from pbkv.trace.call import Call, Trace, TraceMeta
from pbkv.trace.io import read_trace, validate
from pbkv.trace.stats import (END, MarkovPredictor, conditional_entropy, format_stats, markov_stats,
                              percentile_summary, prefix_reuse, tie_order, trace_stats, transitions)

BS = 4
DATA = Path(__file__).resolve().parent / "data"


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
    assert tie_order(END) < tie_order("A") and tie_order(END) < tie_order("<END>")
    assert (m["calls"], m["top1_end"]) == (10, 0.6)


def test_an_agent_named_like_the_end_marker_is_an_agent():
    # A -> X -> A: renaming X (even to "<END>", which the end marker used to be) changes no figure
    def figures(x):
        t = make_trace({"w": ["A", x, "A"]})
        s = trace_stats(t, heldout=t)
        return s["h_next_end"], s["markov"]["top1_end"]
    assert figures("<END>") == figures("B") == (0.667, 0.667)


def test_single_call_workflows_give_none_and_na():
    t = make_trace({"a": ["chat"], "b": ["chat"]})
    s = trace_stats(t, heldout=t)
    assert s["pairs"] == 0 and s["h_next"] is None
    assert s["h_next_end"] == 0.0  # one-call workflows: END is the only next value
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


def test_fixtures_are_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name in gen.FIXTURES:
        assert (DATA / name).read_text(encoding="utf-8") == gen.render(name), name
        read_trace(DATA / name)  # valid


def test_chatdev_fixture_counted_by_hand():
    # chatdev-a: CPO CEO P R P R P; chatdev-b: CPO CEO P R P T P; chatdev-c: CPO P R P
    # (CPO/CEO = Chief Product/Executive Officer, P = Programmer, R = Code Reviewer,
    # T = Software Test Engineer); every prompt is 4 blocks: role (2), task (1), message (1).
    t = read_trace(DATA / "chatdev-mini.jsonl")
    s = trace_stats(t, heldout=t)
    json.dumps(s)
    assert s["workload"] == "chatdev"
    assert (s["workflows"], s["calls"], s["agents"], s["pairs"]) == (3, 18, 5, 15)
    assert s["agent_calls"] == [["Programmer", 8], ["Code Reviewer", 4], ["Chief Product Officer", 3],
                                ["Chief Executive Officer", 2], ["Software Test Engineer", 1]]
    assert s["calls_per_workflow"] == {"median": 7, "p90": 7, "max": 7}  # sorted 4, 7, 7
    # within a workflow, a call whose role already ran in it hits its 3 role+task blocks: a 3
    # calls, b 2, c 1 -> 18 of 72 blocks; globally also the 2 role blocks of a role that ran in an
    # earlier workflow: b's CPO CEO P R, c's CPO P R -> 7 x 2 = 14 more -> 32 / 72
    assert (s["reuse_within_workflow"], s["reuse_global"]) == (0.25, 0.444)
    # successors: CPO -> CEO 2, P 1; CEO -> P 2; P -> R 4, T 1; R -> P 4; T -> P 1 (15 pairs)
    # H = 3/15 H(2/3, 1/3) + 5/15 H(4/5, 1/5) = 0.2 * 0.9183 + 0.3333 * 0.7219 = 0.424
    # with END (3 more, all after P): 3/18 * 0.9183 + 8/18 * H(4/8, 1/8, 3/8) = 0.1531 + 0.6247
    assert (s["h_next"], s["h_next_end"]) == (0.424, 0.778)
    m = s["markov"]  # fit and tested on the same file
    assert (m["pairs"], m["calls"], m["unseen"]) == (15, 18, 0)
    # predicts CPO->CEO, CEO->P, P->R, R->P, T->P: wrong only on CPO->P and P->T -> 13 / 15;
    # with END, P->R is still the most frequent (4 of 8): wrong also on the 3 P->END -> 13 / 18
    assert (m["top1"], m["top1_end"]) == (0.867, 0.722)
    assert m["same"] == 0.0  # no role follows itself
    assert m["top"] == 0.533  # P is the most frequent next role: 8 of 15 pairs
    assert "- workflows 3, calls 18, consecutive agent pairs 15" in format_stats(s)


def test_bfcl_fixture_counted_by_hand():
    # prompts grow: call k of a workflow = 3 shared system blocks + task + k history blocks
    t = read_trace(DATA / "bfcl-mini.jsonl")
    s = trace_stats(t, heldout=t)
    assert (s["workflows"], s["calls"], s["pairs"]) == (3, 14, 11)
    assert s["agent_calls"][0] == ["responder", 6]
    assert s["input_length"]["max"] == 8 * 16  # step 4: 4 + 4 blocks
    # blocks: 4n + n(n-1)/2 per workflow of n calls: 30 + 30 + 22 = 82; within a workflow call k > 0
    # hits all 3 + k blocks of call k-1: 22 + 22 + 15 = 59; globally the first calls of bfcl-2 and
    # bfcl-3 also hit the 3 system blocks: 65
    assert (s["reuse_within_workflow"], s["reuse_global"]) == (round(59 / 82, 3), round(65 / 82, 3))
    assert s["markov"]["same"] == round(2 / 11, 3)  # GorillaFileSystem and VehicleControlAPI repeat once


def test_dialogue_fixture_counted_by_hand():
    # one agent; call k = 2 system blocks + k + 1 turns; workflows of 4, 3 and 2 calls
    t = read_trace(DATA / "dialogue-mini.jsonl")
    s = trace_stats(t, heldout=t)
    assert (s["workflows"], s["calls"], s["agents"], s["pairs"]) == (3, 9, 1, 6)
    # blocks 18 + 12 + 7 = 37; within: call k > 0 hits the 2 + k blocks of call k-1: 12 + 7 + 3 = 22;
    # globally the first calls of dlg-2 and dlg-3 also hit the 2 system blocks: 26
    assert (s["reuse_within_workflow"], s["reuse_global"]) == (0.595, 0.703)
    assert s["h_next"] == 0.0 and s["h_next_end"] == 0.918  # H(6/9, 3/9): next is the agent or END
    m = s["markov"]
    assert (m["top1"], m["same"], m["top"]) == (1.0, 1.0, 1.0)
    assert m["top1_end"] == 0.667  # always predicts the agent (6 of 9), never END
