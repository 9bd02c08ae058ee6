"""`pbkv simcheck --profile P`: the table's caption names the profile the simulator ran on (not
"the calibrated profile" whatever it was), and a profile of another model than --model is
warned about (its costs and capacities are that model's)."""

from __future__ import annotations

import pbkv.bench.simcheck
from helpers import flat, invoke
from pbkv.bench.simcheck import shape_mismatch
from pbkv.engine.profiles import load_profile

TINY = {"name": "tiny", "params_b": 139584 / 1e9, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
        "dtype_bytes": 4}


def fake_rows(policies):
    row = {"device_tokens": 100, "host_tokens": 0, "disk_tokens": 0}
    for key, _, _ in pbkv.bench.simcheck.COMPARED:
        row[f"real_{key}"] = row[f"sim_{key}"] = 1.0
    return [{**row, "policy": p} for p in policies]


def test_a_profile_of_another_model_is_warned_about():
    line = shape_mismatch(load_profile("a6000-qwen3-32b"), TINY)
    assert line.startswith("warning: profile a6000-qwen3-32b is for another model than the one replayed (they "
                           "differ in params, layers, heads, kv_heads, head_dim, dtype_bytes): Qwen3-32B: ")
    assert "replayed tiny: 0.1396 M params, 2 layers, 4 heads, 2 KV heads x 16, 4-byte dtype" in line
    assert "pbkv calibrate --model tiny" in line


def test_the_models_own_profile_is_not_warned_about():
    prof = load_profile("a6000-qwen3-32b")
    same = {**prof.model.model_dump(), "name": "a local copy"}
    assert shape_mismatch(prof, same) is None
    assert shape_mismatch(prof, {**same, "params_b": same["params_b"] * 1.005}) is None  # within 1%
    assert "(they differ in params)" in shape_mismatch(prof, {**same, "params_b": same["params_b"] * 1.02})
    assert "(they differ in kv_heads)" in shape_mismatch(prof, {**same, "kv_heads": 4})


def test_the_caption_names_the_profile(tmp_path, monkeypatch):
    seen = {}

    def fake(source, policies, *a, note=None, **k):
        note("warning: profile x is for another model")
        seen["note"] = True
        return fake_rows(policies)
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", fake)
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workflows", 2, "--policies", "lru",
               "--concurrency", 1, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "simulator on profile a6000-qwen3-32b" in out and "calibrated profile" not in out
    assert "warning: profile x is for another model" in out
