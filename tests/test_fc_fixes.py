"""Fixes of hostile review 7 (repro/N): each test fails on the code before its fix."""

import json
from pathlib import Path

from typer.testing import CliRunner

from pbkv.cli import app

runner = CliRunner()


def _gen(tmp_path: Path, workload: str = "hover", n: int = 4, name: str | None = None) -> Path:
    out = tmp_path / (name or f"{workload}.jsonl")
    r = runner.invoke(app, ["gen", workload, "-o", str(out), "--workflows", str(n)])
    assert r.exit_code == 0, r.output
    return out


def _fake_predictor(tmp_path: Path) -> Path:
    """The layout of a saved predictor (not loadable: the checks under test come before loading)."""
    pred = tmp_path / "pred"
    (pred / "v000001").mkdir(parents=True)
    (pred / "CURRENT").write_text("v000001")
    (pred / "v000001" / "config.json").write_text('{"format": "pbkv-predictor"}')
    return pred


def _one_line(output: str) -> str:
    return " ".join(output.split())


# ---- repro/29: an output inside the --predictor folder being read
def test_predict_eval_json_inside_the_predictor_is_refused(tmp_path):
    pred, trace = _fake_predictor(tmp_path), _gen(tmp_path)
    for target in (pred / "v000001" / "config.json", pred / "CURRENT", pred / "new.json"):
        before = target.read_text() if target.exists() else None
        r = runner.invoke(app, ["predict-eval", "--predictor", str(pred), "--trace", str(trace),
                                "--json", str(target)])
        assert r.exit_code == 2, r.output
        assert f"--json {target} is inside the --predictor {pred}" in _one_line(r.output), r.output
        assert (target.read_text() if target.exists() else None) == before


def test_bench_outputs_inside_the_predictor_are_refused(tmp_path):
    pred, trace = _fake_predictor(tmp_path), _gen(tmp_path)
    r = runner.invoke(app, ["bench", "--trace", str(trace), "--predictor", str(pred), "--policies", "lru",
                            "--concurrency", "2", "--out", str(tmp_path / "o"), "--json", str(pred / "config.json")])
    assert r.exit_code == 2, r.output
    assert "is inside the --predictor" in _one_line(r.output), r.output
    r = runner.invoke(app, ["bench", "--trace", str(trace), "--predictor", str(pred), "--policies", "lru",
                            "--concurrency", "2", "--out", str(pred)])
    assert r.exit_code == 2, r.output
    assert "is inside the --predictor" in _one_line(r.output), r.output


# ---- repro/24: an unusable predictor cache is found before training
def test_a_cache_that_is_a_file_fails_before_training(monkeypatch, tmp_path):
    import pbkv.bench.predictors as predictors

    def trained(*args, **kwargs):
        raise AssertionError("trained before the cache folder was checked")
    monkeypatch.setattr(predictors, "_train_and_save", trained)
    cache = tmp_path / "cachefile"
    cache.write_text("not a folder")
    monkeypatch.setenv("PBKV_CACHE", str(cache))
    r = runner.invoke(app, ["bench", "--workload", "hover", "--workflows", "2", "--policies", "lru,pbkv",
                            "--concurrency", "2", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert f"$PBKV_CACHE={cache}/predictors: {cache} is not a folder" in _one_line(r.output), r.output
