"""`pbkv calibrate`'s fits on given timings (nothing is timed here): the fitted profile must
reproduce the measurements it came from, as the simulator's cost model reads it.

The real HF engine decodes running requests one after another (one forward each), so its decode
step at batch B is ~ B x one request's step; the prefill fit must not keep an intercept from a
fit noise made meaningless."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pbkv.engine.cost import CostModel
from pbkv.engine.hf.calibrate import fit_decode, fit_prefill, to_profile
from pbkv.engine.profiles import builtin_profiles, load_profile, profile_from_data

KV_TOKEN = 512  # bytes per KV token of the fake model below: 2 x 2 layers x 1 kv head x 32 x 4 bytes


def fake_lm():
    """What `to_profile` reads of a loaded model (the shape of `tiny`), no model loaded."""
    return SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(num_attention_heads=2)), layers=2,
                           head_dim=32, kv_heads=1, dtype=torch.float32, kv_bytes_per_token=KV_TOKEN,
                           name="fake", device=torch.device("cpu"))


def measured(prefill, decode) -> dict:
    return {"prefill": prefill, "decode": decode, "kv_bytes": 16384, "host": {"big": 3e-6, "small": 2.6e-6},
            "disk": {"big": 4e-5, "small": 2.7e-5}, "params": 139584, "threads": 1}


CLEAN_PREFILL = [{"new": n, "cached": c, "seconds": s} for n, c, s in
                 ((64, 0, 0.8e-3), (128, 0, 1.1e-3), (256, 0, 1.7e-3), (64, 256, 0.9e-3), (128, 256, 1.3e-3))]


def cost(m: dict) -> CostModel:
    return CostModel(profile_from_data(to_profile(fake_lm(), m, "x"), "x"))


def test_calibrated_decode_step_grows_with_the_batch_as_the_real_engine_does():
    # measured on tiny (one CPU thread): 0.470 ms per one-request step at 16 tokens of context,
    # 0.966 ms at 512; the real engine took 0.49 / 2.30 / 7.69 ms per step at batch 1 / 4 / 16
    # (16-token contexts); the old fit gave 0.578 / 0.590 / 0.641 ms
    cm = cost(measured(CLEAN_PREFILL, [{"context": 16, "seconds": 0.470e-3}, {"context": 512, "seconds": 0.966e-3}]))
    for batch in (1, 4, 16):
        assert cm.decode_step_seconds(batch, batch * 16) == pytest.approx(batch * 0.470e-3, rel=1e-9)
        # a long context costs what the long measurement took, once per request
        assert cm.decode_step_seconds(batch, batch * 512) == pytest.approx(batch * 0.966e-3, rel=1e-9)


def test_fit_decode_on_given_figures():
    # 0.4 ms fixed + 1 us per context token: KV_TOKEN bytes per us = 0.512 GB/s
    request, hbm = fit_decode([{"context": 16, "seconds": 0.416e-3}, {"context": 512, "seconds": 0.912e-3}], KV_TOKEN)
    assert request == pytest.approx(0.4e-3) and hbm == pytest.approx(0.512)
    # a long context measured faster than the short one (noise): no context term, the short step per request
    request, hbm = fit_decode([{"context": 16, "seconds": 0.5e-3}, {"context": 512, "seconds": 0.45e-3}], KV_TOKEN)
    assert request == pytest.approx(0.5e-3, rel=1e-5) and hbm == 1e4


def test_decode_step_when_the_prefill_intercept_exceeds_the_decode_step():
    # a prefill fixed cost (2 ms) above the one-request decode step (0.3 ms): the old fit clamped
    # the compute term to 1 us and gave 2 ms per step at any batch
    prefill = [{"new": n, "cached": 0, "seconds": 2e-3 + n * 1e-5} for n in (64, 128, 256)]
    cm = cost(measured(prefill, [{"context": 16, "seconds": 0.3e-3}, {"context": 512, "seconds": 0.3e-3}]))
    assert cm.decode_step_seconds(1, 16) == pytest.approx(0.3e-3, rel=1e-6)
    assert cm.decode_step_seconds(8, 128) == pytest.approx(2.4e-3, rel=1e-6)


def test_fit_prefill_on_clean_figures():
    flops = [1e9, 2e9, 4e9]
    overhead, per_flop = fit_prefill(flops, [1e-3 + f * 1e-12 for f in flops])
    assert overhead == pytest.approx(1e-3) and per_flop == pytest.approx(1e-12)


# raw figures of a real `pbkv calibrate --max-len 32 --repeats 1` on a busy CPU: least squares
# gives a negative slope, and the old fallback kept its 12.1 ms intercept with a no-overhead rate
NOISY_PREFILL = [{"new": 8, "cached": 0, "seconds": 0.01048}, {"new": 16, "cached": 0, "seconds": 0.0034},
                 {"new": 8, "cached": 16, "seconds": 0.00366}, {"new": 16, "cached": 16, "seconds": 0.00101}]


def test_a_noise_dominated_prefill_fit_has_no_overhead_and_stays_near_the_measurements():
    m = measured(NOISY_PREFILL, [{"context": 16, "seconds": 0.00287}, {"context": 32, "seconds": 0.00376}])
    prof = profile_from_data(to_profile(fake_lm(), m, "x"), "x")
    cm = CostModel(prof)
    assert prof.step_overhead_ms == 0.0
    predicted = [cm.prefill_seconds(cm.prefill_flops(p["new"], p["cached"])) for p in NOISY_PREFILL]
    assert max(predicted) <= max(p["seconds"] for p in NOISY_PREFILL)
    # the line through the origin: sum(flops x seconds) / sum(flops^2)
    flops = [cm.prefill_flops(p["new"], p["cached"]) for p in NOISY_PREFILL]
    per_flop = sum(f * p["seconds"] for f, p in zip(flops, NOISY_PREFILL)) / sum(f * f for f in flops)
    assert predicted == pytest.approx([f * per_flop for f in flops], rel=1e-9)
    assert any("worst run off by" in s for s in prof.sources)
    # no fit of a fixed cost + FLOPs / rate is within 2x of these (the most work measured fastest):
    # the profile says so, and `pbkv calibrate` prints it
    assert any(s.startswith("warning: the prefill timings are noise-dominated") for s in prof.sources)


def test_a_clean_prefill_fit_has_no_warning():
    m = measured(CLEAN_PREFILL, [{"context": 16, "seconds": 0.47e-3}, {"context": 512, "seconds": 0.9e-3}])
    assert not any(s.startswith("warning") for s in to_profile(fake_lm(), m, "x")["sources"])


def test_a_negative_prefill_intercept_refits_through_the_origin():
    flops = [1e9, 2e9, 4e9]
    secs = [0.5e-3, 1.6e-3, 3.8e-3]  # least squares: intercept < 0
    overhead, per_flop = fit_prefill(flops, secs)
    assert overhead == 0.0
    assert per_flop == pytest.approx(sum(f * s for f, s in zip(flops, secs)) / sum(f * f for f in flops))


@pytest.mark.parametrize("name", builtin_profiles())
def test_builtin_profiles_keep_the_batched_decode_step(name):
    prof = load_profile(name)
    assert prof.decode_request_ms is None
    cm, m = CostModel(prof), prof.model
    compute = 2 * m.params_b * 1e9 * 64 / (prof.gpu.count * prof.gpu.tflops * 1e12 * prof.decode_mfu)
    memory = (prof.weight_bytes + prof.kv_bytes_per_token * 64 * 2000) / (prof.gpu.count * prof.gpu.hbm_gbps * 1e9
                                                                          * prof.decode_bw_eff)
    assert cm.decode_step_seconds(64, 64 * 2000) == max(compute, memory) + prof.step_overhead_ms / 1e3


def test_a_profile_without_decode_request_ms_loads_and_one_with_it_must_be_a_number():
    data = json.loads(load_profile("a6000-qwen3-32b").model_dump_json())
    del data["decode_request_ms"]
    assert profile_from_data(data, "p").decode_request_ms is None
    with pytest.raises(ValueError, match="decode_request_ms"):
        profile_from_data({**data, "decode_request_ms": -1.0}, "p")
