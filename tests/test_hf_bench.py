"""`pbkv bench --engine hf`: the driver's lanes run the real engine; the pbkv policy reads hidden states."""

import json
from types import SimpleNamespace

import numpy as np
import torch
from typer.testing import CliRunner

from hf_helpers import BS, lm, make_engine, random_prompt  # noqa: F401
from helpers import FakePredictor
from pbkv.cli import app
from pbkv.policy import PolicyContext


def test_bench_on_the_real_engine(tmp_path):
    threads = torch.get_num_threads()
    try:
        r = CliRunner().invoke(app, ["bench", "--engine", "hf", "--model", "tiny", "--workload", "hover",
                                     "--workflows", "3", "--concurrency", "2", "--policies", "lru", "--scale", "8",
                                     "--device-tokens", "600", "--out", str(tmp_path), "--jobs", "1"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    assert "hover on tiny (scale 8.0)" in r.output
    assert "latencies are wall-clock, one run per cell" in " ".join(r.output.split())   # the noise caveat
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [x["policy"] for x in records] == ["lru", "oracle"]
    for x in records:
        assert x["engine"] == "hf" and x["calls"] > 0 and 0 < x["computed_tokens"] < x["prompt_tokens"]
        assert x["device_hit_rate"] > 0 and x["wall_seconds"] > 0 and x["device_tokens"] == 600


def test_bench_rejects_bad_real_engine_options(tmp_path):
    run = CliRunner().invoke
    r = run(app, ["bench", "--engine", "hf", "--scale", "0.5", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--scale" in r.output
    r = run(app, ["bench", "--engine", "hf", "--model", str(tmp_path / "none"), "--workload", "hover",
                  "--workflows", "2", "--concurrency", "1", "--policies", "lru", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "local model directory" in r.output
    r = run(app, ["bench", "--engine", "gpu", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "available: sim, hf" in r.output


class HiddenPredictor(FakePredictor):
    """A predictor that reads the serving model's hidden state (context_dim > 0)."""

    def __init__(self, dim):
        super().__init__(["user"], 1)
        self.cfg = SimpleNamespace(uses_context=True, context_dim=dim)
        self.hiddens = []

    def predict(self, history, context=None, hidden=None):
        self.hiddens.append(hidden)
        return super().predict(history, context)


def test_pbkv_policy_predicts_again_with_the_hidden_state(lm):
    pred = HiddenPredictor(lm.hidden_size)
    engine = make_engine(lm, device=400, policy="pbkv", ctx=PolicyContext(block_size=BS, predictors={"fused": pred}))
    engine.generate(random_prompt(5, 20), 1, workflow=None)
    assert engine.policy.reads_hidden
    # at call start no hidden state exists yet; after prefill the prediction is redone with it
    assert pred.hiddens[0] is None and pred.hiddens[1].shape == (lm.hidden_size,)
    assert np.all(np.isfinite(pred.hiddens[1]))


def test_calibrate_then_simcheck_side_by_side(tmp_path):
    from pbkv.engine.profiles import load_profile
    threads = torch.get_num_threads()
    try:
        run = CliRunner().invoke
        r = run(app, ["calibrate", "--model", "tiny", "-o", str(tmp_path / "p.json"), "--max-len", "64",
                      "--repeats", "1"])
        assert r.exit_code == 0, r.output
        prof = load_profile(str(tmp_path / "p.json"))
        assert prof.model.layers == 2 and prof.max_prefill_tokens == 1 and prof.gpu.tflops > 0
        r = run(app, ["simcheck", "--model", "tiny", "--profile", str(tmp_path / "p.json"), "--workflows", "3",
                      "--concurrency", "2", "--policies", "lru", "--scale", "16", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "simcheck.json").read_text())
    assert [x["policy"] for x in rows] == ["lru"]
    row = rows[0]
    assert row["real_device_hit_rate"] > 0 and row["sim_device_hit_rate"] > 0
    assert "lat s" in r.output and "PASS rank by recomputed tokens" in r.output


def test_simcheck_verdict_checks_rank_and_speedup_tolerance():
    from pbkv.bench.simcheck import verdict

    def row(policy, real_lat, sim_lat, real_re, sim_re):
        return {"policy": policy, "real_mean_workflow_latency_s": real_lat, "sim_mean_workflow_latency_s": sim_lat,
                "real_recomputed_tokens": real_re, "sim_recomputed_tokens": sim_re}
    lines = verdict([row("lru", 10.0, 5.0, 100, 100), row("pbkv", 8.0, 4.5, 50, 60)])
    assert lines[0].startswith("PASS rank by latency") and lines[1].startswith("PASS rank by recomputed")
    # real 1.25x vs simulated 1.111x: +12.5%, inside 15%
    assert lines[2].startswith("PASS pbkv speedup over lru: real 1.250x, simulated 1.111x (+12.5%")
    lines = verdict([row("lru", 10.0, 5.0, 100, 100), row("pbkv", 11.0, 4.0, 50, 60)])
    assert lines[0].startswith("FAIL rank by latency") and lines[2].startswith("FAIL pbkv")


def test_calls_failing_in_the_engine_fail_the_bench(tmp_path):
    """A model whose positions are fewer than the prompts: every forward pass raises, the engine
    ends each call with "error". bench used to exit 0 with a negative mean TTFT and recomputed =
    prompt tokens; now it names the failed calls and writes no figures."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)).save_pretrained(
        tmp_path / "m")
    threads = torch.get_num_threads()
    try:
        r = CliRunner().invoke(app, ["bench", "--engine", "hf", "--model", str(tmp_path / "m"), "--workload", "hover",
                                     "--workflows", "2", "--concurrency", "2", "--policies", "lru", "--scale", "16",
                                     "--out", str(tmp_path / "o"), "--jobs", "1"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 2, r.output
    assert ("error: hover lru c=2: 13 of 13 calls failed in the engine (first: hover-0-00000 step 0: "
            "IndexError: index out of range in self); no figures written") in " ".join(r.output.split())
    assert not (tmp_path / "o" / "bench.json").exists()


def test_recorder_leaves_failed_calls_out_of_the_figures():
    from pbkv.driver import Recorder
    from pbkv.engine.request import Request
    from pbkv.trace import Call
    rec = Recorder()
    ok = Request(call=Call("w", 0, "a", 10, 2, [1]), workflow=0, on_done=None, arrival=1.0, finish_reason="length",
                 first_token=1.5, finished=2.0, recomputed=10)
    bad = Request(call=Call("w", 1, "a", 30, 2, [1]), workflow=0, on_done=None, arrival=3.0, finish_reason="error",
                  error="IndexError: index\nout of range", recomputed=30)
    rec.call_finished(ok)
    rec.call_finished(bad)
    s = rec.summary()
    assert (rec.failed, rec.first_error) == (1, "w step 1: IndexError: index out of range")
    assert s["calls"] == 2 and s["mean_ttft_s"] == 0.5 and s["recomputed_tokens"] == 10 and s["prompt_tokens"] == 10
    assert "failed_calls" not in s   # the simulator's records keep their keys


def test_a_model_folder_whose_weights_do_not_fit_its_config_is_refused(tmp_path, capfd):
    """Before: missing layers / another model_type ran on random weights; a truncated file or a
    shape mismatch was a bare SafetensorError / RuntimeError not naming the folder. transformers'
    own table of the missing weights (tens of lines) no longer comes before the one-line error."""
    import pytest
    from transformers import GPT2Config, GPT2LMHeadModel

    from pbkv.engine.hf import ModelLoadError, load_model
    from pbkv.engine.hf.model import tiny_model

    def folder(name, **config):
        tiny_model(0).save_pretrained(tmp_path / name)
        c = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**c, **config}))
        return str(tmp_path / name)

    cases = {folder("layers", num_hidden_layers=3): "9 weight(s) missing: model.layers.2.input_layernorm.weight "
                                                    "and 8 more; the config.json and the weights do not describe "
                                                    "the same model",
             folder("shape", intermediate_size=256): "6 weight(s) of another shape: model.layers.0.mlp.down_proj."
                                                     "weight and 5 more; the config.json and the weights do not "
                                                     "describe the same model"}
    trunc = folder("trunc")
    data = (tmp_path / "trunc" / "model.safetensors").read_bytes()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[:len(data) // 2])
    cases[trunc] = "Error while deserializing header: incomplete metadata, file not fully covered"
    other = folder("other")
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)).save_pretrained(
        tmp_path / "gpt2")
    (tmp_path / "other" / "model.safetensors").write_bytes((tmp_path / "gpt2" / "model.safetensors").read_bytes())
    cases[other] = ("21 weight(s) missing: lm_head.weight and 20 more; 28 weight(s) unexpected: "
                    "transformer.h.0.attn.c_attn.bias and 27 more; the config.json")
    for path, why in cases.items():
        with pytest.raises(ModelLoadError) as e:
            load_model(path, device="cpu")
        assert str(e.value).startswith(f"{path}: cannot load the model ({why}"), str(e.value)
    assert "MISSING" not in capfd.readouterr().err
    assert load_model(str(tmp_path / "gpt2"), device="cpu").layers == 2   # a whole folder still loads


def test_bench_hf_refuses_every_pressure_but_auto(tmp_path):
    """Before: --pressure profile was silently ignored on --engine hf (it ran at the hf defaults,
    not the profile's sizes), while --pressure 0.3 was refused only after training."""
    for pressure in ("profile", "0.3"):
        r = CliRunner().invoke(app, ["bench", "--engine", "hf", "--model", "tiny", "--workload", "hover",
                                     "--workflows", "2", "--policies", "lru", "--pressure", pressure,
                                     "--out", str(tmp_path)])
        assert r.exit_code == 2, r.output
        assert (f"error: --pressure {pressure}: sizes the simulator's memory; with --engine hf give "
                f"--device-tokens") in " ".join(r.output.split())
        assert "training" not in r.output and not (tmp_path / "bench.json").exists()


def test_bench_hf_device_below_the_largest_scaled_call_fails_before_training(tmp_path, monkeypatch):
    """Before: the capacity error came only after the predictors were trained (minutes)."""
    from pbkv.bench import predictors

    def never(*a, **kw):
        raise AssertionError("trained before checking --device-tokens")
    monkeypatch.setattr(predictors, "prepare", never)
    r = CliRunner().invoke(app, ["bench", "--engine", "hf", "--model", "tiny", "--workload", "hover",
                                 "--workflows", "3", "--concurrency", "2", "--policies", "pbkv", "--scale", "16",
                                 "--device-tokens", "200", "--out", str(tmp_path), "--jobs", "1"])
    assert r.exit_code == 2, r.output
    assert ("error: hover: call hover-0-00001 step 5 needs 208 tokens, more than the device capacity of 200; "
            "raise --device-tokens") in " ".join(r.output.split())
