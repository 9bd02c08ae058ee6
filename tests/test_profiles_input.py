"""Numbers that used to pass the input checks and then overflow mid-run: a profile's Infinity, NaN
or absurd magnitude, `--scale inf`, a seed past 64 bits. Each is refused before any work, with a
message naming the file (or option), the field and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.engine.cost import CostModel
from pbkv.engine.profiles import builtin_profiles, load_profile

BASE = "a6000-qwen3-32b"
TRACE = Path(__file__).parent / "data" / "chatdev-mini.jsonl"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def flat(output: str) -> str:
    """The output on one line: rich wraps long errors and draws boxes around usage errors."""
    return " ".join(output.replace("│", " ").split())


def profile_with(tmp_path: Path, field: str, value: float) -> Path:
    """The built-in profile BASE with `field` ('gpu.hbm_gbps': nested) set to `value`, as JSON
    (Python's json writes inf as Infinity and nan as NaN, as a hand edit would)."""
    data = json.loads(load_profile(BASE).model_dump_json())
    *parents, leaf = field.split(".")
    obj = data
    for key in parents:
        obj = obj[key]
    obj[leaf] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field, value, message", [
    ("host_ratio", float("inf"), "Input should be a finite number, got inf"),
    ("gpu.hbm_gbps", float("inf"), "Input should be a finite number, got inf"),
    ("gpu.pcie_gbps", float("inf"), "Input should be a finite number, got inf"),
    ("step_overhead_ms", float("inf"), "Input should be a finite number, got inf"),
    ("gpu.memory_gib", float("inf"), "Input should be a finite number, got inf"),
    ("gpu.tflops", float("nan"), "Input should be a finite number, got nan"),
    ("disk_gbps", float("-inf"), "Input should be a finite number, got -inf"),
    ("gpu.hbm_gbps", 1e-300, "Input should be greater than or equal to 0.000001, got 1e-300"),
    ("gpu.pcie_gbps", 1e300, "Input should be less than or equal to 1000000, got 1e\\+300"),
    ("prefill_mfu", 1e-300, "Input should be greater than or equal to 0.000001, got 1e-300"),
    ("load_latency_ms", 1e300, "Input should be less than or equal to 1000000, got 1e\\+300"),
    ("model.layers", 10 ** 30, "Input should be less than or equal to 1000000, got 10{30}"),
])
def test_a_non_finite_or_absurd_profile_number_is_refused_naming_file_field_value(tmp_path, field, value, message):
    path = profile_with(tmp_path, field, value)
    with pytest.raises(ValueError, match=f"p.json: field '{field}': {message}"):
        load_profile(str(path))


def test_bench_refuses_an_infinite_profile_value_with_one_error_line_exit_2(tmp_path):
    path = profile_with(tmp_path, "host_ratio", float("inf"))
    r = invoke("bench", "--trace", TRACE, "--policies", "lru", "--concurrency", 4, "--jobs", 1,
               "--out", tmp_path / "o", "--profile", path, "--pressure", "profile")
    assert r.exit_code == 2, r.output
    assert "p.json: field 'host_ratio': Input should be a finite number, got inf" in flat(r.output)
    assert "OverflowError" not in r.output


@pytest.mark.parametrize("name", builtin_profiles())
def test_every_builtin_profile_is_within_the_bounds_and_costs_finite(name):
    cost = CostModel(load_profile(name))
    assert cost.tokens_per_second_pcie() > 0 and cost.load_seconds([0, 1000, 1000]) < float("inf")


def test_the_extremes_of_the_bounds_give_finite_costs(tmp_path):
    slow = json.loads(load_profile(BASE).model_dump_json())
    slow["gpu"].update(tflops=1e-6, hbm_gbps=1e-6, pcie_gbps=1e-6)
    slow.update(prefill_mfu=1e-6, decode_mfu=1e-6, decode_bw_eff=1e-6, pcie_eff=1e-6, disk_gbps=1e-6,
                load_latency_ms=1e6, disk_latency_ms=1e6, step_overhead_ms=1e6, host_ratio=1e6)
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    p = load_profile(str(tmp_path / "slow.json"))
    cost = CostModel(p)
    seconds = [cost.prefill_seconds(cost.prefill_flops(10 ** 6, 10 ** 6)), cost.decode_step_seconds(256, 10 ** 8),
               cost.load_seconds([0, 10 ** 8, 10 ** 8])]
    assert all(0 < s < float("inf") for s in seconds)
    assert int(cost.tokens_per_second_pcie() * max(seconds)) >= 0 and p.host_tokens > 0


# ---------------------------------------------------------------- command-line numbers

@pytest.mark.parametrize("option, value", [("--scale", "inf"), ("--scale", "nan"), ("--scale", "-inf"),
                                           ("--output-scale", "inf")])
def test_bench_hf_refuses_a_non_finite_scale(tmp_path, option, value):
    r = invoke("bench", "--engine", "hf", "--trace", TRACE, "--policies", "lru", "--concurrency", 2, "--jobs", 1,
               "--out", tmp_path / "o", f"{option}={value}")
    assert r.exit_code == 2, r.output
    assert f"{option}: must be a finite number >= 1, got {value}" in r.output


@pytest.mark.parametrize("value, bound", [("99999999999999999999999", "less than or equal to 9223372036854775807"),
                                          ("-1", "greater than or equal to 0")])
def test_train_refuses_a_seed_outside_0_to_2_63_before_training(tmp_path, value, bound):
    r = invoke("train", "--trace", TRACE, "-o", tmp_path / "p", f"--seed={value}")
    assert r.exit_code == 2, r.output
    assert "--seed" in r.output and bound in flat(r.output)
    assert "Overflow" not in r.output and not (tmp_path / "p").exists()


@pytest.mark.parametrize("command", [["gen", "hover", "-o", "g.jsonl"], ["bench"], ["ablate"], ["predict-eval"],
                                     ["simcheck"], ["trace", "split", str(TRACE), "--train-out", "a.jsonl", "--test-out", "b.jsonl"]])
def test_every_seed_option_has_the_same_range(command):
    r = invoke(*command, "--seed", 2 ** 64)
    assert r.exit_code == 2 and "--seed" in r.output and "Overflow" not in r.output, r.output


def test_the_largest_seed_trains(tmp_path):
    r = invoke("train", "--trace", TRACE, "-o", tmp_path / "p", "--epochs", 1, "--seed", 2 ** 63 - 1)
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------- unknown fields, lax types

def profile_data(**changes) -> dict:
    """BASE as a dict, top-level `changes` applied (None removes the field)."""
    data = json.loads(load_profile(BASE).model_dump_json())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("where, field", [("top", "step_overhead_msec"), ("gpu", "tflop"), ("model", "layer")])
def test_a_misspelt_profile_field_is_refused_not_ignored(tmp_path, where, field):
    data = profile_data()
    (data if where == "top" else data[where])[field] = 500.0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    loc = field if where == "top" else f"{where}.{field}"
    with pytest.raises(ValueError, match=f"p.json: field '{loc}': unknown field"):
        load_profile(str(path))


@pytest.mark.parametrize("field, value, message", [
    ("step_overhead_ms", "500", "Input should be a valid number"),
    ("max_running", True, "Input should be a valid integer"),
    ("max_running", 64.0, "Input should be a valid integer"),
    ("sources", "one line", "Input should be a valid list"),
])
def test_a_profile_value_of_the_wrong_type_is_refused_not_coerced(tmp_path, field, value, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_data(**{field: value})))
    with pytest.raises(ValueError, match=f"p.json: field '{field}': {message}"):
        load_profile(str(path))


def test_a_profile_int_is_a_valid_float(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_data(step_overhead_ms=500)))
    assert load_profile(str(path)).step_overhead_ms == 500.0


def test_bench_refuses_a_misspelt_profile_field_exit_2(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(profile_data(step_overhead_ms=None, step_overhead_msec=500.0)))
    r = invoke("bench", "--trace", TRACE, "--policies", "lru", "--concurrency", 4, "--jobs", 1,
               "--out", tmp_path / "o", "--profile", path, "--pressure", "profile")
    assert r.exit_code == 2, r.output
    assert "typo.json: field 'step_overhead_msec': unknown field" in flat(r.output)
    assert "Traceback" not in r.output


def test_a_profile_key_written_twice_is_refused(tmp_path):
    data = json.loads((Path(load_profile.__code__.co_filename).parent / "profiles" / "a6000-qwen3-32b.json").read_text())
    text = json.dumps(data)[:-1] + ', "step_overhead_ms": 500}'
    (tmp_path / "twice.json").write_text(text)
    with pytest.raises(ValueError, match=r"twice.json: not valid JSON: duplicate key 'step_overhead_ms'"):
        load_profile(str(tmp_path / "twice.json"))


def test_a_profile_nested_too_deeply_is_refused_naming_the_file(tmp_path):
    """Before: a bare RecursionError (exit 1), naming no file."""
    path = tmp_path / "deep.json"
    path.write_text('{"notes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"deep.json: not valid JSON \(nested too deeply\)$"):
        load_profile(str(path))


def test_a_profile_without_kv_memory_names_the_file_and_the_fields(tmp_path):
    """Before: 'profile a6000-qwen3-32b: weights and reserve leave no KV memory', naming the
    built-in the file was copied from (its `name`), not the file or the fields."""
    profile = load_profile(str(profile_with(tmp_path, "model.params_b", 200.0)))
    with pytest.raises(ValueError, match=r"p.json: model.params_b 200 x model.dtype_bytes 2 \(400 GB of weights over "
                       r"gpu.count 4 GPUs\) and reserve_gib 3 leave no KV memory in gpu.memory_gib 48 x "
                       r"mem_fraction 0.9 per GPU$"):
        profile.device_tokens
