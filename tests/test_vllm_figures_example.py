"""examples/vllm_figures.py without vLLM: `run_policy` (one vLLM child process per setup) is
stood in for, so what the example hands to each run, and what it refuses up front, is checked."""

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECORD = dict(calls=1, prompt_tokens=2, computed_tokens=1, vllm_hit_tokens=1, ram_hit_tokens=0,
              disk_hit_tokens=0, demoted_blocks=0, wall_seconds=0.5)


@pytest.fixture
def vf(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("vllm_figures", None)
    import vllm_figures
    sent = []

    def run_policy(workload, policy, concurrency, cfg, predictor_dir=None):
        sent.append((policy, predictor_dir, cfg.model))
        return dict(RECORD, policy=policy)

    monkeypatch.setattr(vllm_figures, "run_policy", run_policy)
    vllm_figures.sent = sent
    yield vllm_figures
    sys.modules.pop("vllm_figures", None)


def main(vf, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["vllm_figures.py", "--workflows", "1", *argv])
    vf.main()


def test_predictor_goes_only_to_the_policies_that_read_one(vf, monkeypatch, tmp_path):
    main(vf, monkeypatch, "--model", str(tmp_path), "--policies", "lru,pbkv-retired,pbkv", "--predictor",
         str(tmp_path))
    assert [(p, d) for p, d, _ in vf.sent] == [("vllm", None), ("lru", None), ("pbkv-retired", None),
                                               ("pbkv", str(tmp_path))]


@pytest.mark.parametrize("argv, message", [
    (["--policies", "lru,pbkv"], "--policies: pbkv reads a trained predictor; give --predictor DIR "
                                 "(saved by `pbkv train`)"),
    (["--policies", "lru", "--predictor", "P"], "--predictor P: none of --policies lru reads a trained "
                                                "predictor (pbkv does)"),
    (["--policies", "pbkv", "--predictor", "/nonexistent/p"], "--predictor /nonexistent/p: not a directory"),
    (["--policies", "lru,oracle"], "--policies: oracle reads the replayed trace's future; the connector "
                                   "cannot run it"),
    (["--policies", "pbkv-history", "--predictor", "."], "--policies: pbkv-history reads the 'history' "
                                                         "predictor variant; --predictor stands for the fused "
                                                         "one (policy pbkv's)"),
])
def test_policies_and_predictor_are_checked_before_any_run(vf, monkeypatch, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(vf, monkeypatch, *argv)
    assert e.value.code == 2 and vf.sent == []
    assert capsys.readouterr().err == f"vllm_figures.py: error: {message}\n"


def test_default_model_is_left_to_resolve_model_and_empty_pbkv_cache_is_unset(vf, monkeypatch):
    """The default --model was always a path ($PBKV_CACHE/smollm2-135m-instruct, "" + that with
    PBKV_CACHE empty), so resolve_model never converted SmolLM2 as `pbkv bench --engine vllm`
    does. Now it is None (resolve_model's choice), and an empty PBKV_CACHE is taken as unset."""
    monkeypatch.setenv("PBKV_CACHE", "")
    seen = []
    monkeypatch.setattr(vf, "run_policy", lambda wl, policy, conc, cfg, d=None: seen.append(
        (cfg.model, vf.os.environ.get("PBKV_CACHE"))) or dict(RECORD, policy=policy))
    main(vf, monkeypatch, "--policies", "lru")
    assert seen == [(None, None), (None, None)]


def test_a_model_that_cannot_be_had_is_one_line(vf, monkeypatch, capsys):
    import pbkv.bench.vllm_run as vr
    from pbkv.engine.hf import model as hm

    def no_conversion():
        raise hm.ModelLoadError("stub: no converter")

    monkeypatch.setattr(vr, "find_python", lambda p: sys.executable)
    monkeypatch.setattr(hm, "converted_smollm2", no_conversion)
    monkeypatch.setattr(vf, "run_policy", vr.run_policy)
    with pytest.raises(SystemExit) as e:
        main(vf, monkeypatch, "--policies", "lru")
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert err.startswith("vllm_figures.py: --engine vllm runs SmolLM2-135M-Instruct from ")
    assert "converting it here failed: stub: no converter." in err
