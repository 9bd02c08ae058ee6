"""`pbkv serve` options that act only with `--replicas N` (no Ray: the servers are faked): with
`--replicas 1` each one the user gave is named in a warning; with N > 1 a port already taken is
refused before Ray and the replicas start."""

from __future__ import annotations

import socket
import sys
import types

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


@pytest.fixture
def fake_replicas(monkeypatch):
    """The replicas' app, without Ray: the calls it got (none when the CLI refused first)."""
    import pbkv.scale.options as options
    runs = []
    monkeypatch.setattr(options, "local_machine", lambda: (2, 0))
    fake = types.ModuleType("pbkv.scale.serve_app")
    fake.run = lambda cfg, opts, log_level, layout_checked=False: runs.append(cfg.port)
    monkeypatch.setitem(sys.modules, "pbkv.scale.serve_app", fake)
    return runs


def test_with_replicas_a_port_in_use_is_refused_before_ray_starts(fake_replicas):
    """It was found only when the ingress's uvicorn bound it, after Ray and every replica had
    started (~30 s here); exit 3, as the single-process server's (uvicorn's) refusal."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", str(port)])
    out = " ".join(r.output.split())
    assert r.exit_code == 3, r.output
    assert f"cannot bind 127.0.0.1:{port}" in out and "choose another --port" in out, out
    assert fake_replicas == []                       # the replicas were never started


def test_with_replicas_a_host_not_of_this_machine_is_named_as_the_fault(fake_replicas):
    """It said 'another server may be using it; choose another --port' for a bad --host too."""
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--host", "10.255.255.1", "--api-key", "k"])
    out = " ".join(r.output.split())
    assert r.exit_code == 3 and "cannot bind 10.255.255.1:8000" in out and "check --host" in out, out
    assert "--port" not in out.split("):")[-1] and fake_replicas == []


def test_with_replicas_a_free_port_or_port_0_starts_them(fake_replicas):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    for port in (free, 0):
        r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", str(port)])
        assert r.exit_code == 0, r.output
    assert fake_replicas == [free, 0]
