"""`pbkv bench --predictor DIR` checks the predictor before any run and says what its figures hide:
another variant than policy pbkv's fused one, a --horizon beyond the predictor's, replayed agents
it never saw. `--online` retrains at the predictor's horizon and variant, never swaps in a retrain
trained on fewer workflows than the predictor it replaces, counts its retrains in bench.json and
says when none was used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbkv.bench import predictors
from pbkv.bench.main import online_notes
from pbkv.bench.sweep import trace_source
from pbkv.cli import app
from pbkv.predict import load_predictor, save_predictor, train_predictor
from pbkv.trace import read_trace

TRACE = Path(__file__).parent / "data" / "chatdev-mini.jsonl"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A fused predictor at horizon 2 and a context one, each saved."""
    root, trace = tmp_path_factory.mktemp("p"), read_trace(TRACE)
    return {v: save_predictor(train_predictor(trace, variant=v, horizon=2, epochs=1, seed=0), root / v)
            for v in ("fused", "context")}


def bench(*args) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["bench", *map(str, args)])
    return r.exit_code, " ".join(r.output.split())


def test_bench_refuses_a_predictor_of_another_variant(saved, tmp_path):
    code, said = bench("--trace", TRACE, "--predictor", saved["context"], "--policies", "pbkv", "--out", tmp_path)
    assert code != 0 and "a context predictor (config.json variant 'context')" in said, said
    assert "pbkv-context" in said and not (tmp_path / "bench.json").exists()


def test_bench_refuses_a_horizon_beyond_the_predictor_before_any_run(saved, tmp_path):
    code, said = bench("--trace", TRACE, "--predictor", saved["fused"], "--horizon", 5, "--policies", "pbkv",
                       "--out", tmp_path)
    assert code != 0 and f"--horizon 5 exceeds the horizon 2 of --predictor {saved['fused']}" in said, said
    assert "lru" not in said   # refused before the lru cells ran (their progress names them)


def test_bench_notes_replayed_agents_the_predictor_never_saw(saved, tmp_path):
    lines = TRACE.read_text().splitlines()
    renamed = [lines[0]] + [json.dumps({**json.loads(x), "agent": "stranger"}) for x in lines[1:]]
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(renamed) + "\n")
    code, said = bench("--trace", other, "--predictor", saved["fused"], "--policies", "pbkv", "--out", tmp_path / "o")
    assert code == 0 and f"note: other: --predictor {saved['fused']}: 18 of 18 positions have an agent the " \
                         "predictors never saw (stranger)" in said, said


def test_online_learner_retrains_at_the_predictor_horizon_and_variant(saved):
    p = load_predictor(saved["fused"])
    learner = predictors.online_learner(trace_source(str(TRACE)), [], p)
    assert (learner.horizon, learner.variant, learner.every) == (2, "fused", predictors.LEARN_EVERY)
    assert learner.floor == p.info["workflows"]   # no training set: only the window, which can reach it


class Trained:
    def __init__(self, workflows: int):
        self.info = {"workflows": workflows}


class StubLearner(predictors.ReplayLearner):
    """Its retrain 'trains' on as many workflows as the window holds, at once."""

    def _train(self, traces) -> None:
        self._ready = Trained(len(self.window))
        self.retrains += 1


def test_a_retrain_on_fewer_workflows_than_the_predictor_is_not_used():
    learner = StubLearner(every=2)
    learner.floor = 3
    for _ in range(2):
        learner.add(["a", "b"], [None, None])
    assert learner.poll() is None and (learner.used, learner.dropped) == (0, 1)
    for _ in range(2):
        learner.add(["a", "b"], [None, None])
    assert learner.poll().info == {"workflows": 4} and (learner.used, learner.dropped) == (1, 1)


def test_bench_online_records_retrains_and_notes_when_none_was_used(saved, tmp_path):
    code, said = bench("--trace", TRACE, "--predictor", saved["fused"], "--policies", "pbkv", "--online",
                       "--pressure", "0.5", "--tiers", "device", "--out", tmp_path)
    assert code == 0 and "note: --online: chatdev-mini pbkv c=64 (device pressure 0.5): no retrain was used " \
                         "(3 workflows finished, a retrain comes every 200)" in said, said
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [r.get("online_retrains") for r in records] == [None, 0, None]   # lru, pbkv, oracle


def test_online_notes_name_unused_retrains_and_nothing_without_online():
    record = {"workload": "w", "policy": "pbkv", "concurrency": 8, "workflows": 500, "online_retrains": 0,
              "online_retrains_unused": 2}
    args = type("Args", (), {"online": True})()
    assert online_notes([record], args) == ["note: --online: w pbkv c=8: no retrain was used (2 retrain(s) learned "
                                            "from fewer workflows than the predictor it started with); it ran as "
                                            "without --online"]
    args.online = False
    assert online_notes([record], args) == []


def test_serve_refuses_a_predictor_of_another_variant(saved):
    from pbkv.serve.learning import build_policy
    with pytest.raises(ValueError, match=r"a context predictor \(config.json variant 'context'\); policy pbkv "
                                         r"needs a fused one"):
        build_policy("pbkv", 16, saved["context"], online=False)


@pytest.mark.parametrize("command", [["train", "--trace", TRACE], ["predict-eval", "--train", TRACE,
                                     "--test", TRACE], ["bench", "--trace", TRACE, "--policies", "pbkv"]],
                         ids=["train", "predict-eval", "bench"])
@pytest.mark.parametrize("horizon", [0, 2000])
def test_horizon_out_of_range_names_the_option(command, horizon, tmp_path):
    out = ["-o", tmp_path / "P"] if command[0] == "train" else ["--out", tmp_path] if command[0] == "bench" else []
    r = CliRunner().invoke(app, [*map(str, command + out), "--horizon", str(horizon)])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"--horizon: must be from 1 to 1,024, got {horizon}" in said, said


def test_a_damaged_cache_entry_names_the_cache_and_says_to_delete_it(saved, tmp_path, monkeypatch):
    import shutil
    from pbkv.predict.store import live_dir
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path / "cache"))
    entry = shutil.copytree(saved["fused"], tmp_path / "cache" / "predictors" / "w-damaged")
    weights = live_dir(entry) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(ValueError, match=rf"is bench's cached predictor, kept under \$PBKV_CACHE={tmp_path}/cache: "
                                         r"delete that folder and the next bench trains it again"):
        predictors.load(str(entry))
    outside = shutil.copytree(entry, tmp_path / "mine")
    with pytest.raises(ValueError) as e:
        predictors.load(str(outside))
    assert "cached" not in str(e.value)


def test_online_notes_name_each_cell_once_with_its_regimes():
    base = {"workload": "w", "policy": "pbkv", "concurrency": 8, "workflows": 20, "online_retrains": 0}
    records = [base | {"tiers": "device", "pressure": 0.05}, base | {"tiers": "device+host", "pressure": 0.05},
               base | {"concurrency": 16, "tiers": "device", "pressure": 0.05}]
    args = type("Args", (), {"online": True})()
    assert online_notes(records, args) == [
        "note: --online: w pbkv c=8 (device pressure 0.05, device+host pressure 0.05): no retrain was used "
        "(20 workflows finished, a retrain comes every 200); it ran as without --online",
        "note: --online: w pbkv c=16 (device pressure 0.05): no retrain was used (20 workflows finished, a "
        "retrain comes every 200); it ran as without --online"]


def test_bench_notes_replayed_agents_a_train_file_never_showed(tmp_path):
    """--train FILE gets the note --predictor DIR gets (agents with under min_count calls are unknown)."""
    code, said = bench("--trace", TRACE, "--train", TRACE, "--policies", "pbkv", "--pressure", "0.5",
                       "--tiers", "device", "--out", tmp_path)
    assert code == 0 and f"note: chatdev-mini: --train {TRACE}: 3 of 18 positions have an agent the " \
                         f"predictors never saw" in said, said
