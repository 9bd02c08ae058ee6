"""`pbkv serve --replicas N` at shutdown, without Ray: the ingress asks every replica to stop
before the deployment is deleted, hears each failed predictor save, and `pbkv serve` then exits 1
as one process does; a replica's shutdown runs once, and it passes health checks meanwhile."""

from __future__ import annotations

import asyncio
import sys
import types
from types import SimpleNamespace

import pytest

from pbkv.scale import handoff, ingress
from pbkv.scale.replica import EngineReplica
from pbkv.serve import ServeConfig


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


def stopped(error=None, unsaved=()):
    return {"save_error": error, "unsaved": list(unsaved)}


def test_the_ingress_collects_the_replicas_save_errors():
    handle = Handle(stopped(), stopped("[Errno 20] Not a directory"), stopped())
    assert ingress.stop_replicas(handle, ServeConfig(model="tiny"), 16) == ["[Errno 20] Not a directory"]
    assert handle.asked == ["stop"]
    assert ingress.stop_replicas(Handle(stopped(), stopped()), ServeConfig(model="tiny"), 16) == []


class Watch:
    def check(self):
        raise RuntimeError("the engine thread has died")


def replica(steps: list, error: str | None = None) -> EngineReplica:
    r = object.__new__(EngineReplica)   # Ray's constructor needs a running deployment
    setup = SimpleNamespace(save_error=None, unsaved=[], hand_off=False)

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
    assert asyncio.run(r.stop()) == stopped("[Errno 20] Not a directory")
    r.check_health()                      # stopped on purpose: Ray must not kill it mid-save
    assert asyncio.run(r.stop()) == stopped("[Errno 20] Not a directory")
    r.__del__()                           # Ray's graceful stop afterwards
    assert steps == ["worker.stop", "save"]
    assert asyncio.run(replica([]).stop()) == stopped()


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


# ---------------------------------------------------------------- workflows left over (handoff)

def workflows(n: int, tag: str) -> list:
    return [[("planner", f"{tag} task {i}"), ("coder", f"{tag} code {i}"), ("tester", None)] for i in range(n)]


def replica_setup(folder, ended: list):
    """A replica's policy set-up after `ended` workflows ended on it (no background retrain ran)."""
    from pbkv.serve.learning import build_policy
    setup = build_policy("pbkv", 16, folder, learn_steps=5)
    for wf in ended:
        setup.learner.add([a for a, _ in wf], [c for _, c in wf])
    return setup


def test_a_replica_with_too_few_workflows_hands_them_off_instead_of_dropping_them(tmp_path, caplog):
    from pbkv.serve.learning import finish_learning
    setup = replica_setup(tmp_path / "pred", workflows(6, "a"))
    setup.hand_off = True
    assert finish_learning(setup) is None
    assert setup.unsaved == workflows(6, "a") and setup.save_error is None
    assert "they are not kept" not in caplog.text and not (tmp_path / "pred").exists()
    single = replica_setup(tmp_path / "one", workflows(6, "a"))   # one process: as before
    assert finish_learning(single) is None and single.unsaved == []
    assert "they are not kept" in caplog.text


def test_the_ingress_trains_on_what_the_replicas_left_and_saves_as_one_process_would(tmp_path):
    from pbkv.predict.history import read_history
    from pbkv.predict.store import has_predictor
    folder = tmp_path / "pred"
    cfg = ServeConfig(model="tiny", predictor_dir=str(folder), learn_steps=5)
    answers = [stopped(unsaved=workflows(6, "a")), stopped(unsaved=workflows(6, "b"))]   # 2 x 6 < 10 each
    errors, left = handoff.pooled(answers)
    assert errors == [] and len(left) == 12
    assert handoff.learn_left_over(cfg, 16, left) is None
    assert has_predictor(folder) and len(read_history(folder)) == 12


def test_too_few_workflows_over_all_replicas_save_nothing_as_one_process(tmp_path, caplog):
    folder = tmp_path / "pred"
    cfg = ServeConfig(model="tiny", predictor_dir=str(folder), learn_steps=5)
    assert handoff.learn_left_over(cfg, 16, workflows(3, "a") + workflows(4, "b")) is None
    assert not folder.exists() and "(7 did); they are not kept" in caplog.text


def test_a_save_of_the_pooled_workflows_that_fails_is_an_error(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    cfg = ServeConfig(model="tiny", predictor_dir=str(tmp_path / "afile" / "pred"), learn_steps=5)
    assert handoff.learn_left_over(cfg, 16, workflows(12, "a"))
