"""A hand-edited predictor folder is validated at load: a negative, non-finite or overflowing
Markov count or `alpha`, a NaN, zero, subnormal or missing temperature is refused with the file,
the field and the value, instead of loading and silently changing the accuracy figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.predict import MarkovPredictor, PredictorLoadError, load_predictor, save_predictor, train_predictor
from pbkv.predict.store import live_dir

TRACE = Path(__file__).parent / "data" / "chatdev-mini.jsonl"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    from pbkv.trace import read_trace
    return save_predictor(train_predictor(read_trace(TRACE), epochs=1, seed=0), tmp_path_factory.mktemp("p") / "m")


def edited(saved: Path, tmp_path: Path, name: str, edit) -> Path:
    """A copy of the saved predictor whose live `name` (a JSON file) is changed by `edit(data)`."""
    folder = shutil.copytree(saved, tmp_path / "m")
    path = live_dir(folder) / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))  # inf and nan as Infinity and NaN, as a hand edit would
    return folder


def set_count(value):
    def edit(d):
        d["counts"][0][3] = value
    return edit


def set_temperature(key, value):
    def edit(d):
        d["temperature"][key][0] = value
    return edit


@pytest.mark.parametrize("name, edit, message", [
    ("markov.json", set_count(-50), r"field 'counts': expected numbers from 0 to 1e\+15, got -50.0 at row 0, column 3"),
    ("markov.json", set_count(float("nan")), r"field 'counts': expected numbers from 0 to 1e\+15, got nan at row 0"),
    ("markov.json", set_count(float("inf")), r"field 'counts': expected numbers from 0 to 1e\+15, got inf at row 0"),
    ("markov.json", set_count(1e308), r"field 'counts': expected numbers from 0 to 1e\+15, got 1e\+308 at row 0"),
    ("markov.json", lambda d: d.update(alpha=-0.5), r"field 'alpha': expected a number from 0 to 1e\+15, got -0.5"),
    ("markov.json", lambda d: d.update(alpha=float("nan")), r"field 'alpha': expected a number from 0 to 1e\+15, got nan"),
    ("markov.json", lambda d: d.update(alpha=1e308), r"field 'alpha': expected a number from 0 to 1e\+15, got 1e\+308"),
    ("markov.json", lambda d: d.update(alpha="1"), r"field 'alpha': expected a number from 0 to 1e\+15, got '1'"),
    ("markov.json", lambda d: d.update(horizon=2.5), r"field 'horizon': expected an integer >= 1, got 2.5"),
    ("config.json", set_temperature("agent", float("nan")),
     r"field 'temperature.agent': expected 3 numbers from 0.001 to 1000, got \[nan, "),
    ("config.json", set_temperature("continue", 0), r"field 'temperature.continue': expected 3 numbers from 0.001"),
    ("config.json", set_temperature("agent", float("inf")), r"field 'temperature.agent': expected 3 numbers"),
    ("config.json", set_temperature("agent", 1e-320), r"field 'temperature.agent': expected 3 numbers .*, got \[1e-320, "),
    ("config.json", set_temperature("continue", 1e4), r"field 'temperature.continue': expected 3 numbers .*, got \[10000.0, "),
    ("config.json", lambda d: d["temperature"]["agent"].pop(), r"field 'temperature.agent': expected 3 numbers"),
    ("config.json", lambda d: d["temperature"].pop("continue"),
     r"field 'temperature.continue': expected 3 numbers from 0.001 to 1000, got None"),
    ("config.json", lambda d: d.update(horizon=5), r"field 'horizon' is 5, model.horizon is 3"),
    ("config.json", lambda d: d.update(variant="history"), r"field 'variant' is 'history', model.variant is 'fused'"),
    ("config.json", lambda d: d["hashing"].update(buckets=8), r"field 'hashing.buckets' is 8, model.features.buckets is 4096"),
    ("config.json", lambda d: d["hashing"].update(method="md5"),
     r"field 'hashing.method' is 'md5', expected 'zlib.crc32 % buckets'"),
    ("config.json", lambda d: d.update(hashing=[]), r"field 'hashing': expected an object, got \[\]"),
], ids=["count-negative", "count-nan", "count-inf", "count-overflowing", "alpha-negative", "alpha-nan",
        "alpha-overflowing", "alpha-string", "horizon-float", "temperature-nan", "temperature-zero",
        "temperature-inf", "temperature-subnormal", "temperature-huge", "temperature-short", "temperature-missing",
        "copy-horizon", "copy-variant", "copy-buckets", "copy-method", "copy-hashing-not-object"])
def test_a_bad_edited_field_is_refused_at_load_naming_file_field_value(saved, tmp_path, name, edit, message):
    folder = edited(saved, tmp_path, name, edit)
    with pytest.raises(PredictorLoadError, match=f"{name}: .*{message}"):
        load_predictor(folder)


@pytest.mark.parametrize("name, key", [("config.json", "dropout"), ("markov.json", "alpha")])
def test_a_key_written_twice_is_refused_naming_it(saved, tmp_path, name, key):
    """Before: json.loads kept the last value without a word (profiles and spec files refuse it)."""
    folder = shutil.copytree(saved, tmp_path / "m")
    path = live_dir(folder) / name
    text = path.read_text()
    at = text.index(f'"{key}"')
    path.write_text(text[:at] + f'"{key}": 0.2, ' + text[at:])
    with pytest.raises(PredictorLoadError, match=rf"{name}: .*\(duplicate key '{key}': line"):
        load_predictor(folder)


def test_the_saved_predictor_itself_loads(saved):
    p = load_predictor(saved)
    assert p.markov is not None and len(p.t_agent) == p.horizon


def test_predict_eval_refuses_a_negative_count_with_exit_2(saved, tmp_path):
    folder = edited(saved, tmp_path, "markov.json", set_count(-50))
    r = CliRunner().invoke(app, ["predict-eval", "--predictor", str(folder), "--trace", str(TRACE)])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "markov.json: not a valid Markov model (field 'counts': expected numbers from 0 to 1e+15, got -50.0" in out


def test_markov_constructor_keeps_the_invariants():
    with pytest.raises(ValueError, match=r"field 'counts': .* got -1.0 at row 1, column 0"):
        MarkovPredictor(["a"], np.array([[0, 0, 0], [-1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"field 'alpha': expected a number from 0 to 1e\+15, got inf"):
        MarkovPredictor(["a"], np.zeros((3, 3)), alpha=float("inf"))
    assert MarkovPredictor(["a"], np.zeros((3, 3)), alpha=0.0).alpha == 0.0  # alpha 0: no smoothing, allowed


def with_weights(saved: Path, tmp_path: Path, edit) -> Path:
    """A copy of the saved predictor whose tensors are replaced by `edit(dict of tensors)`."""
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(saved, tmp_path / "w")
    path = live_dir(folder) / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pbkv-predictor", "version": "1"})
    return folder


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_naming_file_and_tensor(saved, tmp_path, value):
    def edit(state):
        state["head.weight"][0, 0] = value
    folder = with_weights(saved, tmp_path, edit)
    with pytest.raises(PredictorLoadError, match=r"model.safetensors: tensor head.weight holds 1 non-finite"):
        load_predictor(folder)


@pytest.mark.parametrize("dtype", ["int32", "bool", "float16"])
def test_weights_of_another_dtype_are_refused_naming_file_tensor_and_dtype(saved, tmp_path, dtype):
    """Before: load_state_dict cast them to float32 and predict-eval scored the collapsed network."""
    import torch

    def edit(state):
        state.update({k: v.to(getattr(torch, dtype)) for k, v in state.items()})
    folder = with_weights(saved, tmp_path, edit)
    with pytest.raises(PredictorLoadError, match=rf"model.safetensors: tensor \S+ has dtype {dtype}, expected float32"):
        load_predictor(folder)


def test_a_weight_shape_mismatch_names_tensor_both_shapes_and_config_field(saved, tmp_path):
    folder = shutil.copytree(saved, tmp_path / "m")
    path = live_dir(folder) / "config.json"
    data = json.loads(path.read_text())
    data["model"]["features"]["buckets"] = data["hashing"]["buckets"] = 8   # config.json agrees with itself
    path.write_text(json.dumps(data))
    with pytest.raises(PredictorLoadError, match=r"model.safetensors: tensor text.weight has shape \[4097, 32\], "
                       r"config.json \(model.features.buckets 8, model.dim 32\) expects \[9, 32\]"):
        load_predictor(folder)


def test_missing_tensors_are_named(saved, tmp_path):
    folder = with_weights(saved, tmp_path, lambda state: state.pop("text.weight"))
    with pytest.raises(PredictorLoadError, match=r"model.safetensors: missing tensors text.weight for "
                       r"config.json's variant 'fused'"):
        load_predictor(folder)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(horizon=9), r"markov.json: field 'horizon' is 9, config.json's is 3"),
    (lambda d: d.update(agents=[f"x{i}" for i in range(len(d["agents"]))]),
     r"markov.json: field 'agents' lacks '.*' of config.json's agents"),
], ids=["horizon", "agents"])
def test_a_markov_json_of_another_predictor_is_refused(saved, tmp_path, edit, message):
    folder = edited(saved, tmp_path, "markov.json", edit)
    with pytest.raises(PredictorLoadError, match=message):
        load_predictor(folder)
