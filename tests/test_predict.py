"""The workflow predictor: Markov by hand, neural predictor invariants, save/load, training,
evaluation metrics by hand, task split, CLI. Small synthetic traces, few epochs (fast)."""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.predict import (UNK, MarkovPredictor, Prediction, PredictorLoadError, check_prediction, evaluate,
                          fit_markov, load_predictor, save_predictor, split_by_task, train_predictor)
from pbkv.predict.evaluate import ece
from pbkv.predict.features import FeatureConfig, text_features
from pbkv.predict.store import live_dir
from pbkv.trace import Call, Trace, TraceMeta, write_trace

runner = CliRunner()


def make_trace(workflows: list[list[str]], contexts: list[list[str | None]] | None = None) -> Trace:
    """One call per agent, 16-token prompts with a fresh hash id each (a valid v1 trace)."""
    calls, nid = [], 0
    for w, agents in enumerate(workflows):
        for s, a in enumerate(agents):
            ctx = contexts[w][s] if contexts else None
            calls.append(Call(workflow_id=f"wf{w:04d}", step=s, agent=a, input_length=16, output_length=1,
                              hash_ids=[nid], context=ctx, done=s == len(agents) - 1))
            nid += 1
    return Trace(meta=TraceMeta(), calls=calls)


def routed(n: int, seed: int = 0, tasks: bool = True) -> Trace:
    """A router whose next agent is named by a word of the context (alpha/beta, 50/50), then a
    reviewer, then END. From the agents alone the router's successor is a coin flip. With `tasks`
    the context starts with a "task:" line: two task groups, which `split_by_task` keeps whole."""
    rng = np.random.default_rng(seed)
    wfs, ctxs = [], []
    for _ in range(n):
        word = "alpha" if rng.random() < 0.5 else "beta"
        wfs.append(["router", f"{word}_worker", "reviewer"])
        ctx = f"{'task: ' if tasks else ''}please handle the {word} request now"
        ctxs.append([ctx, ctx + "\nprevious output: done", ctx + "\nprevious output: reviewed"])
    return make_trace(wfs, ctxs)


@pytest.fixture(scope="module")
def fused():
    return train_predictor(routed(200), variant="fused", epochs=40, seed=0)


# ---------------------------------------------------------------- Markov

def test_markov_deterministic_chain_by_hand():
    m = fit_markov(make_trace([["A", "B"]] * 3), horizon=3, alpha=0.0)
    p = m.predict(["A"])
    assert p.agents == ["A", "B", UNK]
    assert p.top(1) == "B" and np.allclose(p.probs[0], [0, 1, 0])
    assert np.allclose(p.survival, [1, 0, 0])
    assert np.allclose(m.predict(["B"]).survival, [0, 0, 0])
    start = m.predict([])  # just started: the first agent, then B, then END
    assert np.allclose(start.survival, [1, 1, 0]) and start.top(1) == "A" and start.top(2) == "B"
    unseen = m.predict(["Z"])  # overall next distribution: B after A, END after B (half each)
    assert np.allclose(unseen.survival, [0.5, 0, 0]) and unseen.top(1) == "B"
    for q in (p, start, unseen):
        check_prediction(q, 3)


def test_markov_k_step_propagation_by_hand():
    # A->B 4 times, A->C once, C->A once, B->END 4 times
    m = fit_markov(make_trace([["A", "B"]] * 3 + [["A", "C", "A", "B"]]), horizon=3, alpha=0.0)
    p = m.predict(["X", "A"])
    assert np.allclose(p.survival, [1.0, 0.2, 0.2])
    assert np.allclose(p.probs[0], [0, 0.8, 0.2, 0]) and np.allclose(p.probs[1], [1, 0, 0, 0])
    assert np.allclose(p.probs[2], [0, 0.8, 0.2, 0])


def test_markov_laplace_smoothing_and_json(tmp_path):
    m = fit_markov(make_trace([["A", "B"]] * 3), horizon=2)  # alpha = 1
    p = m.predict(["A"])  # row A: (A, B, UNK, END) counts (0, 3, 0, 0) + 1 each -> (1, 4, 1, 1) / 7
    check_prediction(p, 2)
    assert p.probs[0][1] == pytest.approx(4 / 6) and p.survival[0] == pytest.approx(6 / 7)
    m.save(tmp_path / "m.json")
    q = MarkovPredictor.load(tmp_path / "m.json").predict(["A"])
    assert np.array_equal(p.probs, q.probs) and np.array_equal(p.survival, q.survival)
    with pytest.raises(ValueError, match="m2.json"):
        MarkovPredictor.load(tmp_path / "m2.json")


# ---------------------------------------------------------------- neural predictor

ODD_INPUTS = [
    (["router"], None), (["router"], ""), ([], None), ([], "task: x"), (["nobody"], "task: alpha"),
    (["router", "nobody", "alpha_worker"], "x"), (["router"] * 200, "alpha " * 100_000),
    (["router"], "tâche: ünïcode ✓ 任务\n前の出力: 🚀"), (["<unk>"], "\n\n\n"),
]


@pytest.mark.parametrize("history,context", ODD_INPUTS)
def test_predictions_are_valid_distributions_on_odd_inputs(fused, history, context):
    p = fused.predict(history, context)
    check_prediction(p, 3)
    assert p.agents == fused.agents + [UNK]


def test_batch_equals_single(fused):
    batch = fused.predict_batch(ODD_INPUTS)
    for (h, c), b in zip(ODD_INPUTS, batch):
        s = fused.predict(h, c)
        assert np.allclose(s.probs, b.probs, atol=1e-6) and np.allclose(s.survival, b.survival, atol=1e-6)


def test_context_word_is_learned_and_beats_markov_and_history_only(fused):
    train, test = routed(200), routed(100, seed=1)
    history = train_predictor(train, variant="history", epochs=40, seed=0)
    f, h, m = (evaluate(p, test, timing=False) for p in (fused, history, fit_markov(train)))
    assert f["top1_k1"] > 0.95 and f["top1_k2"] > 0.95
    assert f["top1_k1"] > m["top1_k1"] + 0.1 and f["top1_k1"] > h["top1_k1"] + 0.1
    assert f["end_acc"] > 0.95
    assert fused.predict(["router"], "task: please handle the beta request now").top(1) == "beta_worker"


def test_save_load_round_trip_is_identical_and_pickle_free(fused, tmp_path):
    save_predictor(fused, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [".lock", "CURRENT", "v000001"]
    live = live_dir(tmp_path / "m")
    assert sorted(p.name for p in live.iterdir()) == ["config.json", "markov.json", "model.safetensors"]
    config = json.loads((live / "config.json").read_text())
    assert config["agents"] == fused.agents and config["horizon"] == 3 and config["variant"] == "fused"
    loaded = load_predictor(tmp_path / "m")
    for a, b in zip(fused.predict_batch(ODD_INPUTS), loaded.predict_batch(ODD_INPUTS)):
        assert np.array_equal(a.probs, b.probs) and np.array_equal(a.survival, b.survival)
    assert loaded.markov is not None and loaded.markov.agents == fused.markov.agents


def test_load_errors_name_the_path_and_problem(fused, tmp_path):
    with pytest.raises(PredictorLoadError, match="no such predictor directory"):
        load_predictor(tmp_path / "missing")
    d = save_predictor(fused, tmp_path / "bad")
    (live_dir(d) / "config.json").write_text("{not json")
    with pytest.raises(PredictorLoadError, match="config.json"):
        load_predictor(d)
    d = save_predictor(fused, tmp_path / "bad2")
    (live_dir(d) / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(PredictorLoadError, match="model.safetensors"):
        load_predictor(d)
    (live_dir(d) / "model.safetensors").unlink()
    with pytest.raises(PredictorLoadError, match="missing"):
        load_predictor(d)
    (d / "CURRENT").write_text("../../etc\n")
    with pytest.raises(PredictorLoadError, match="version pointer"):
        load_predictor(d)


def test_training_is_deterministic_given_the_seed():
    import torch
    trace = routed(40)
    threads = torch.get_num_threads()
    a, b = (train_predictor(trace, epochs=2, seed=3) for _ in range(2))
    assert torch.get_num_threads() == threads  # training runs on one thread and restores the setting
    c = train_predictor(trace, epochs=2, seed=4)
    pa, pb, pc = (p.predict(["router"], "task: alpha") for p in (a, b, c))
    assert np.array_equal(pa.probs, pb.probs) and np.array_equal(pa.survival, pb.survival)
    assert not np.array_equal(pa.probs, pc.probs)


def test_train_figures_count_the_real_workflows_not_the_unknown_agent_copies():
    # training adds ~10% copies with an agent renamed <unk> (unknown_agent_copies); the figures
    # `pbkv train` prints (samples, train-set top-1) are those of the train set itself
    trace = make_trace([["A", "B", "C"]] * 40)
    p = train_predictor(trace, variant="history", epochs=3, seed=0)
    assert p.info["samples"] == 120 and p.info["refit"]   # 120 positions; refit: on every workflow
    assert p.info["train_top1_k1"] == pytest.approx(evaluate(p, trace, timing=False)["top1_k1"])


def test_rare_agents_become_the_unknown_class():
    wfs = [["a", "b"]] * 30 + [["a", "rare"]]  # 'rare' has 1 call: mapped to UNK in training
    p = train_predictor(make_trace(wfs), epochs=2, seed=0)
    assert p.agents == ["a", "b"]
    check_prediction(p.predict(["a", "rare"]), 3)


def test_context_only_variant_and_hidden_state_input():
    trace = routed(30)
    ctx = train_predictor(trace, variant="context", epochs=2, seed=0)
    check_prediction(ctx.predict([], None), 3)
    hid = train_predictor(trace, epochs=2, seed=0, context_dim=8, hidden_fn=lambda c: np.full(8, c.step, float))
    check_prediction(hid.predict(["router"], hidden=np.ones(8)), 3)
    check_prediction(hid.predict(["router"]), 3)  # no hidden state: a zero vector
    with pytest.raises(ValueError, match="8 values"):
        hid.predict(["router"], hidden=np.ones(3))


def test_text_features_are_deterministic_and_capped():
    cfg = FeatureConfig()
    a = text_features("task: a b c\nprevious output: <INFO> x", cfg)
    assert a == text_features("task: a b c\nprevious output: <INFO> x", cfg)  # crc32, not hash()
    # line 0: 5 tokens + 4 bigrams; line 1: 7 + 6; heads of both lines: (5 + 4) + (7 + 6)
    assert [len(g) for g in a] == [9, 13, 22] and all(0 <= i < cfg.buckets for g in a for i in g)
    assert a[0][0] == zlib.crc32(b"a|task") % cfg.buckets  # the same in every process
    huge = text_features("w " * 10**6, cfg)
    assert len(huge[0]) <= 2 * cfg.max_tokens


# ---------------------------------------------------------------- evaluation

class Constant:
    """Always A 0.7 / B 0.2 / UNK 0.1 at every k; survival 0.6, 0.3."""

    name, horizon, agents = "constant", 2, ["A", "B"]

    def predict(self, history, context=None, hidden=None):
        return Prediction(["A", "B", UNK], np.array([[0.7, 0.2, 0.1]] * 2), np.array([0.6, 0.3]))

    def predict_batch(self, items):
        return [self.predict(h, c) for h, c in items]


def test_evaluate_metrics_by_hand():
    # positions: [A]->B, [A,B]->A, [A,B,A]->end, [B]->Z (unknown), [B,Z]->end
    r = evaluate(Constant(), make_trace([["A", "B", "A"], ["B", "Z"]]))
    assert r["calls"] == 5 and r["n_k1"] == 3 and r["n_k2"] == 1
    assert r["top1_k1"] == pytest.approx(1 / 3) and r["top1_k2"] == pytest.approx(1.0)
    assert r["end_acc"] == pytest.approx(3 / 5)  # never predicts the end (survival 0.6 >= 0.5)
    # joint next event: A .42, B .12, UNK .06, END .4; top-1 is A (conf .42), right once in 5
    assert r["ece"] == pytest.approx(abs(0.2 - 0.42))
    want = -np.mean(np.log([0.12, 0.42, 0.4, 0.06, 0.4]))
    assert r["nll_k1"] == pytest.approx(want)
    assert r["us_per_call"] > 0


def test_unknown_class_is_right_only_for_unknown_agents():
    class Unk(Constant):
        def predict(self, history, context=None, hidden=None):
            return Prediction(["A", "B", UNK], np.array([[0.1, 0.2, 0.7]] * 2), np.array([1.0, 1.0]))
    r = evaluate(Unk(), make_trace([["A", "B", "A"], ["B", "Z"]]), timing=False)
    assert r["top1_k1"] == pytest.approx(1 / 3)  # only [B]->Z
    assert r["us_per_call"] is None


def test_ece_bins():
    assert ece(np.array([0.95, 0.95, 0.25, 0.25]), np.array([1.0, 1.0, 0.0, 1.0])) == pytest.approx(
        0.5 * 0.05 + 0.5 * 0.25)
    assert ece(np.array([1.0]), np.array([1.0])) == 0.0  # confidence 1 falls in the last bin


def test_split_by_task_keeps_tasks_together():
    wfs = [["A", "B"]] * 40
    ctxs = [[f"task: build thing {i % 10}\nmore", "x"] for i in range(40)]
    trace = make_trace(wfs, ctxs)
    train, test = split_by_task(trace)
    assert len(train.calls) + len(test.calls) == len(trace.calls) and train.calls and test.calls
    task = {c.workflow_id: ctxs[int(c.workflow_id[2:])][0].split("\n")[0] for c in trace.calls}
    assert not {task[c.workflow_id] for c in train.calls} & {task[c.workflow_id] for c in test.calls}
    again = split_by_task(trace)[1]
    assert [c.workflow_id for c in again.calls] == [c.workflow_id for c in test.calls]
    plain = split_by_task(make_trace(wfs), test_fraction=0.5)  # no "task:": grouped by workflow id
    assert 5 < len({c.workflow_id for c in plain[1].calls}) < 35
    assert not split_by_task(trace, test_fraction=0.0)[1].calls


# ---------------------------------------------------------------- CLI

def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_train_and_predict_eval(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(routed(60, tasks=False), trace)  # one task per workflow: --split has two halves
    r = invoke("train", "--trace", trace, "-o", tmp_path / "m", "--epochs", 3, "--seed", 1)
    assert r.exit_code == 0, r.output
    assert "parameters" in r.output and "train-set top-1" in r.output
    r = invoke("predict-eval", "--predictor", tmp_path / "m", "--trace", trace, "--json", tmp_path / "a.json")
    assert r.exit_code == 0, r.output
    assert "fused" in r.output and "markov" in r.output
    out = json.loads((tmp_path / "a.json").read_text())
    assert {"top1_k1", "top1_k3", "ece", "markov_top1_k1", "us_per_call", "end_acc"} <= set(out)
    for option, value in (("--horizon", 2), ("--epochs", 5)):   # they shape training: not silently ignored
        r = invoke("predict-eval", "--predictor", tmp_path / "m", "--trace", trace, option, value)
        assert r.exit_code == 2 and f"{option}: a saved --predictor is scored as it was trained" in r.output
    r = invoke("predict-eval", "--trace", trace, "--split", "--epochs", 2, "--json", tmp_path / "b.json")
    assert r.exit_code == 0, r.output
    assert "history-only" in r.output and "context-only" in r.output
    out = json.loads((tmp_path / "b.json").read_text())
    assert {"top1_k1", "top1_k3", "ece", "markov_top1_k1", "us_per_call", "history_top1_k1",
            "context_top1_k1"} <= set(out)
    assert all(v is None or math.isfinite(v) for v in out.values())


def test_cli_bad_inputs_exit_2_bad_files_exit_1(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(routed(5), trace)
    for code, args in [(2, ("predict-eval", "--predictor", tmp_path / "nope", "--trace", trace)),
                       (1, ("predict-eval", "--train", tmp_path / "missing.jsonl", "--test", trace)),
                       (2, ("predict-eval", "--trace", trace)),
                       (1, ("train", "--trace", tmp_path / "missing.jsonl", "-o", tmp_path / "m")),
                       (2, ("train", "--trace", trace, "-o", tmp_path / "m", "--horizon", 0)),
                       (2, ("train", "--trace", trace, "-o", tmp_path / "m", "--variant", "bogus"))]:
        r = invoke(*args)
        assert r.exit_code == code, (args, r.output)  # 1: an input trace is missing or malformed
        assert "error" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"workflow_id": "w"}\n')
    r = invoke("train", "--trace", bad, "-o", tmp_path / "m")
    assert r.exit_code == 1 and "bad.jsonl:1" in r.output
    empty = tmp_path / "empty.jsonl"  # a header, no calls: refused before the three trainings
    empty.write_text('{"pbkv_trace": 1, "block_size": 16}\n')
    r = invoke("predict-eval", "--train", trace, "--test", empty)
    assert r.exit_code == 2 and "empty.jsonl: no calls to evaluate on" in " ".join(r.output.split()), r.output
    assert "training" not in r.output
