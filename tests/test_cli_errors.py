"""`pbkv bench` / `ablate`: a run that fails prints one `error:` line (exit 1), not a traceback;
`--debug` shows the traceback."""

import pbkv.bench.main
from typer.testing import CliRunner

from pbkv.cli import app

runner = CliRunner()


def _boom(args, console):
    raise AttributeError("'NoneType' object has no attribute 'tier'")


def test_a_failed_run_is_one_line_and_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(pbkv.bench.main, "run", _boom)
    args = ["bench", "--workload", "swe", "--workflows", "2", "--concurrency", "2", "--out", str(tmp_path)]
    for command in (args, ["ablate", *args[1:]]):
        r = runner.invoke(app, command)
        assert r.exit_code == 1, r.output
        lines = r.output.strip().splitlines()
        assert lines == ["error: AttributeError: 'NoneType' object has no attribute 'tier' (run again with --debug "
                         "for the traceback)"], r.output
        assert "Traceback" not in r.output
    r = runner.invoke(app, [*args, "--debug"])
    assert isinstance(r.exception, AttributeError) and r.exit_code == 1


def test_a_device_too_small_for_a_call_fails_before_any_training(monkeypatch, tmp_path):
    def trained(*args, **kwargs):
        raise AssertionError("predictors were trained before the capacity was checked")
    monkeypatch.setattr(pbkv.bench.main.predictors_mod, "prepare", trained)
    r = runner.invoke(app, ["bench", "--workload", "swe", "--workflows", "2", "--concurrency", "2",
                            "--device-tokens", "10", "--out", str(tmp_path)])
    assert r.exit_code != 0, r.output
    assert "more than the device capacity of 10; raise --device-tokens" in " ".join(r.output.split()), r.output
    assert "predictors were trained" not in r.output


def test_a_broken_predictor_fails_before_any_run(monkeypatch, tmp_path):
    def sweep(*args, **kwargs):
        raise AssertionError("runs started before the predictor was checked")
    monkeypatch.setattr(pbkv.bench.main, "run_sweep", sweep)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text("x")
    r = runner.invoke(app, ["bench", "--workload", "finance", "--workflows", "2", "--concurrency", "2",
                            "--policies", "pbkv", "--predictor", str(tmp_path / "p"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert "model.safetensors: missing (not a saved predictor directory?)" in " ".join(r.output.split()), r.output


def test_a_bad_model_or_workload_fails_before_training_or_calibrating(monkeypatch, tmp_path):
    import pbkv.bench.simcheck

    def never(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")
    monkeypatch.setattr(pbkv.bench.main.predictors_mod, "prepare", never)
    monkeypatch.setattr(pbkv.bench.simcheck, "calibrate", never)
    nope = str(tmp_path / "nope")
    for args, message in [
        (["bench", "--engine", "hf", "--model", nope, "--out", str(tmp_path / "o")], "not 'tiny', 'smollm2' or a local"),
        (["simcheck", "--model", nope, "--out", str(tmp_path / "o")], "not 'tiny', 'smollm2' or a local"),
        (["simcheck", "--workload", "nope", "--out", str(tmp_path / "o")], "nope: not a built-in workload"),
    ]:
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and message in " ".join(r.output.split()), (args, r.output)
