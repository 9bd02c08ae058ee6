"""`pbkv serve --replicas N` at shutdown, without Ray: the ingress asks every replica to stop
before the deployment is deleted, hears each failed predictor save, and `pbkv serve` then exits 1
as one process does; a replica's shutdown runs once, and it passes health checks meanwhile."""

from __future__ import annotations

import asyncio
import sys
import types
from types import SimpleNamespace

import pytest

from pbkv.scale import ingress
from pbkv.scale.replica import EngineReplica


class Result:
    def __init__(self, value):
        self.value = value

    async def get_async(self):
        return self.value


class Handle:
    """A deployment whose replicas answer `stop` with these values."""

    def __init__(self, *answers):
        self.answers, self.asked = answers, []

    def broadcast(self, method, *args):
        self.asked.append(method)
        handle = self

        class Response:
            async def _fetch_replica_results_async(self):
                return [Result(a) for a in handle.answers]
        return Response()


def test_the_ingress_collects_the_replicas_save_errors():
    handle = Handle(None, "[Errno 20] Not a directory", None)
    assert ingress.stop_replicas(handle) == ["[Errno 20] Not a directory"]
    assert handle.asked == ["stop"]
    assert ingress.stop_replicas(Handle(None, None)) == []


class Watch:
    def check(self):
        raise RuntimeError("the engine thread has died")


def replica(steps: list, error: str | None = None) -> EngineReplica:
    r = object.__new__(EngineReplica)   # Ray's constructor needs a running deployment
    setup = SimpleNamespace(save_error=None)

    def save():
        steps.append("save")
        setup.save_error = error
    r.state, r.own_disk, r.watch = SimpleNamespace(on_shutdown=[lambda: steps.append("worker.stop"), save],
                                                   setup=setup), None, Watch()
    return r


def test_a_replica_stops_once_reports_its_save_error_and_passes_health_checks_while_stopping():
    steps = []
    r = replica(steps, error="[Errno 20] Not a directory")
    with pytest.raises(RuntimeError):
        r.check_health()                  # a dead engine thread before the stop fails the check
    assert asyncio.run(r.stop()) == "[Errno 20] Not a directory"
    r.check_health()                      # stopped on purpose: Ray must not kill it mid-save
    assert asyncio.run(r.stop()) == "[Errno 20] Not a directory"
    r.__del__()                           # Ray's graceful stop afterwards
    assert steps == ["worker.stop", "save"]
    assert asyncio.run(replica([]).stop()) is None


def test_a_replica_not_stopped_by_the_ingress_still_stops_in_its_graceful_stop():
    steps = []
    replica(steps).__del__()
    assert steps == ["worker.stop", "save"]


@pytest.mark.parametrize("errors, code", [([], 0), (None, 0), (["[Errno 20] Not a directory"], 1)])
def test_pbkv_serve_exits_1_when_a_replica_could_not_save_its_predictor(monkeypatch, errors, code):
    from typer.testing import CliRunner

    import pbkv.scale.options as options
    from pbkv.cli import app
    monkeypatch.setattr(options, "local_machine", lambda: (2, 0))
    fake = types.ModuleType("pbkv.scale.serve_app")   # no Ray: what serve_app.run returns
    fake.run = lambda cfg, opts, log_level, layout_checked=False: errors
    monkeypatch.setitem(sys.modules, "pbkv.scale.serve_app", fake)
    r = CliRunner().invoke(app, ["serve", "--replicas", "2"])
    assert r.exit_code == code, r.output
