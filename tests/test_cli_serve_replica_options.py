"""`pbkv serve` options that act only with `--replicas N` (no Ray: the servers are faked): with
`--replicas 1` each one the user gave is named in a warning."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi")

import pbkv.serve  # noqa: E402
from pbkv.cli import app  # noqa: E402


def _one(monkeypatch, *args: str) -> str:
    """`pbkv serve --replicas 1 ARGS` with a server that returns at once: its output."""
    monkeypatch.setattr(pbkv.serve, "run", lambda cfg, log_level: None)
    r = CliRunner().invoke(app, ["serve", "--port", "0", *args])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


@pytest.mark.parametrize("args, named", [
    (["--replica-gpus", "1", "--replica-cpus", "3", "--health-check-period", "1", "--health-check-timeout", "1",
      "--engine-stall", "1"],
     "--replica-cpus, --replica-gpus, --health-check-period, --health-check-timeout and --engine-stall apply only"),
    (["--replica-cpus", "1"], "--replica-cpus applies only with --replicas > 1"),      # given, even at its default
    (["--router", "sticky", "--engine-stall", "2"], "--router and --engine-stall apply only with --replicas > 1"),
])
def test_with_one_replica_the_replica_only_options_given_are_named(monkeypatch, args, named):
    """--replica-cpus/--replica-gpus/--health-check-*/--engine-stall were ignored without a word
    (a user who forgot --replicas 4 got one process and no hint); the warning named --router,
    --ray-address and --measured-costs together whichever was given."""
    out = _one(monkeypatch, *args)
    assert named in out, out
    for other in ("--ray-address", "--measured-costs"):
        assert other not in out


def test_with_one_replica_and_no_replica_option_there_is_no_warning(monkeypatch):
    assert "warning" not in _one(monkeypatch, "--replicas", "1")
