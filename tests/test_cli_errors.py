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
