"""`pbkv calibrate -o PATH` and simcheck's own calibration: the output path is checked before any
measuring (a profile must be a .json file for --profile to read it), the measured profile is
validated by content before it is written, and the write replaces the file whole or not at all."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import pbkv.bench.simcheck
import pbkv.engine.hf.calibrate
from helpers import flat, invoke
from pbkv.engine.profiles import load_profile



@pytest.fixture
def no_measuring(monkeypatch):
    """Loading the model or measuring fails the test: the path must be refused before."""
    def never(*_a, **_k):
        raise AssertionError("measured before the output path was checked")
    monkeypatch.setattr(pbkv.bench.simcheck, "get_model", never)


def fake_measure(monkeypatch, profile: dict):
    """calibrate measures nothing and `to_profile` gives `profile`."""
    monkeypatch.setattr(pbkv.bench.simcheck, "get_model", lambda hf: SimpleNamespace(name="fake"))
    monkeypatch.setattr(pbkv.engine.hf.calibrate, "measure", lambda *a, **k: {})
    monkeypatch.setattr(pbkv.engine.hf.calibrate, "to_profile", lambda lm, m, name: profile)


def good_profile() -> dict:
    return {**json.loads(load_profile("a6000-qwen3-32b").model_dump_json()), "name": "calibrated-fake"}


@pytest.mark.parametrize("name", ["prof.txt", "a10g-llama3.1-8b", "prof"])
def test_calibrate_refuses_an_output_without_json_before_measuring(tmp_path, monkeypatch, no_measuring, name):
    monkeypatch.chdir(tmp_path)
    r = invoke("calibrate", "-o", name, "--max-len", 32, "--repeats", 1)
    assert r.exit_code == 2, r.output
    assert f"{name}: a profile must be a .json file for --profile to read it" in flat(r.output)
    assert not (tmp_path / name).exists() and "Traceback" not in r.output


def test_calibrate_writes_a_valid_profile_to_the_json_path(tmp_path, monkeypatch):
    fake_measure(monkeypatch, good_profile())
    r = invoke("calibrate", "-o", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert load_profile(str(tmp_path / "p.json")).name == "calibrated-fake"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary left


def test_a_measured_profile_that_fails_validation_is_not_written(tmp_path, monkeypatch):
    bad = good_profile()
    bad["gpu"]["tflops"] = 0.0
    fake_measure(monkeypatch, bad)
    out = tmp_path / "p.json"
    out.write_text("the old profile\n")
    r = invoke("calibrate", "-o", out)
    assert r.exit_code == 2, r.output
    assert "field 'gpu.tflops'" in flat(r.output) and "Traceback" not in r.output
    assert out.read_text() == "the old profile\n" and [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_simcheck_refuses_a_folder_at_out_profile_json_before_calibrating(tmp_path, no_measuring):
    (tmp_path / "o" / "profile.json").mkdir(parents=True)
    r = invoke("simcheck", "--model", "tiny", "--policies", "lru", "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert "profile.json is a folder; give a file name" in flat(r.output)
    assert "Errno" not in r.output and "Traceback" not in r.output
