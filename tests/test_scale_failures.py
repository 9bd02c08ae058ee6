"""`pbkv serve --replicas N` when replicas are gone or stuck, on fake deployment handles (no Ray,
except the tests marked `ray`): /metrics answers with what the replicas that answered said,
/v1/workflows/{id}/end answers 503 when none did and never waits on a frozen one, /health counts
the replicas running at the time of the probe; the layout checks refuse what a local Ray could
never place; a replica removes the `--disk-dir` subfolder it created, and a new one those of
replicas killed before their shutdown."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pbkv.scale import adapter, disk, remote  # noqa: E402
from pbkv.scale.ingress import ingress_state  # noqa: E402
from pbkv.scale.metrics_merge import Merger  # noqa: E402
from pbkv.scale.options import ReplicaOptions, check_local, gpus_needed  # noqa: E402
from pbkv.serve import ServeConfig  # noqa: E402
from pbkv.serve.app import create_app  # noqa: E402
from pbkv.serve.errors import APIError  # noqa: E402
from pbkv.serve.metrics import Metrics, parse  # noqa: E402

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
INFO = {"model_name": "tiny", "policy": "pbkv", "tokenizer": None, "max_context": 64, "block_size": 16}


class Unavailable(Exception):
    """Stands for Ray Serve's `DeploymentUnavailableError` (no replica running)."""


@dataclass
class FakeReplica:
    """One replica's behaviour: answers, raises, or never answers (`frozen`, as under SIGSTOP)."""
    id: str
    started: int = 0   # workflows it started: an engine counter the ingress does not count itself
    workflows: set = field(default_factory=set)
    frozen: bool = False
    calls: int = 0

    async def get(self, method: str, args: tuple):
        self.calls += 1
        if self.frozen:
            await asyncio.Event().wait()
        if method == "metrics":
            m = Metrics()
            m.workflows_started.inc(self.started)
            return self.id, m.exposition().decode()
        if method == "end_workflow":
            found = args[0] in self.workflows
            self.workflows.discard(args[0])
            return found
        return INFO | {"replica": self.id}


class FakeResult:
    def __init__(self, replica: FakeReplica, method: str, args: tuple):
        self.replica, self.method, self.args = replica, method, args

    async def get_async(self):
        return await self.replica.get(self.method, self.args)


class FakeResponse:
    """What `handle.broadcast` returns: raises `error` (when set) before any per-replica result."""

    def __init__(self, handle: "FakeHandle", method: str, args: tuple):
        self.handle, self.method, self.args = handle, method, args

    async def _fetch_replica_results_async(self):
        if self.handle.error is not None:
            raise self.handle.error
        return [FakeResult(r, self.method, self.args) for r in self.handle.replicas]

    def results(self, timeout_s=None):   # the sync call the ingress makes once, at start
        return [INFO | {"replica": r.id} for r in self.handle.replicas]


class FakeHandle:
    app_name = "fake-app"

    def __init__(self, *replicas: FakeReplica):
        self.replicas, self.error = list(replicas), None

    def broadcast(self, method: str, *args):
        return FakeResponse(self, method, args)

    def options(self, **_):
        return self


@dataclass(eq=False)   # hashable: the registry is a WeakSet
class FakeRouter:
    """This process's Ray router of the app, as `adapter.running_replicas` reads it."""
    app_name: str
    curr_replicas: dict


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(remote, "REPLICA_TIMEOUT_S", 0.3)


def _ingress(handle: FakeHandle):
    state = ingress_state(ServeConfig(model="tiny", api_key=KEY), handle, len(handle.replicas))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://ingress")


def test_with_every_replica_gone_metrics_health_and_end_answer_without_a_500(short_timeout):
    a, b = FakeReplica("a", started=30), FakeReplica("b", started=12)
    handle = FakeHandle(a, b)
    router = FakeRouter(handle.app_name, {"a": a, "b": b})
    adapter.register_router(router)

    async def main():
        async with _ingress(handle) as http:
            assert parse((await http.get("/metrics", headers=AUTH)).text)["pbkv_workflows_started_total"] == 42
            assert (await http.get("/health")).json()["replicas"] == 2
            handle.error, router.curr_replicas = Unavailable("Deployment(name='PBKVEngine')"), {}   # both killed
            metrics = await http.get("/metrics", headers=AUTH)
            assert metrics.status_code == 200
            got = parse(metrics.text)
            assert got["pbkv_replicas"] == 0 and got["pbkv_workflows_started_total"] == 42   # their last counts
            assert got['pbkv_requests_total{endpoint="/metrics",status="200"}'] == 1     # the ingress's own
            end = await http.post("/v1/workflows/w1/end", headers=AUTH)
            assert end.status_code == 503 and end.headers["retry-after"] == str(remote.RETRY_AFTER_S)
            assert end.json()["error"]["code"] == "replicas_unavailable"
            assert end.json()["error"]["type"] == "server_error"
            health = await http.get("/health")
            assert health.status_code == 503 and health.headers["retry-after"]
            assert health.json()["status"] == "unavailable" and health.json()["replicas"] == 0
            assert (await http.head("/health")).status_code == 503      # a load balancer's probe
    asyncio.run(main())


def test_a_frozen_replica_leaves_metrics_and_end_to_the_others_within_the_timeout(short_timeout):
    a, b = FakeReplica("a", started=5, workflows={"w1"}), FakeReplica("b", started=7)
    handle = FakeHandle(a, b)

    async def main():
        async with _ingress(handle) as http:
            await http.get("/metrics", headers=AUTH)
            a.frozen = True
            start = time.monotonic()
            got = parse((await http.get("/metrics", headers=AUTH)).text)
            assert got["pbkv_replicas"] == 1 and got['pbkv_workflows_started_total{replica="b"}'] == 7
            assert got["pbkv_workflows_started_total"] == 12             # a's last known 5 still counts
            end = await http.post("/v1/workflows/w2/end", headers=AUTH)
            assert end.status_code == 404                               # b answered: it had no run of w2
            assert time.monotonic() - start < 10 * remote.REPLICA_TIMEOUT_S
            b.frozen = True                                             # nobody answers now: 503, not a hang
            assert (await http.post("/v1/workflows/w1/end", headers=AUTH)).status_code == 503
    asyncio.run(main())


class PublicOnlyResponse:
    """A Ray whose broadcast response has only the public all-or-nothing call."""

    def __init__(self, results):
        self.results = results

    async def results_async(self, timeout_s=None, return_exceptions=False):
        assert timeout_s == remote.REPLICA_TIMEOUT_S and return_exceptions
        return self.results


def test_without_rays_per_replica_step_a_broadcast_uses_the_public_call():
    class Handle:
        def broadcast(self, method, *args):
            return PublicOnlyResponse([True, RuntimeError("replica raised"), False])
    assert asyncio.run(remote.broadcast(Handle(), "end_workflow", "w")) == [True, False]


class FrozenPublicResponse:
    """The public call with one replica frozen: Ray's all-or-nothing timeout of the whole broadcast."""

    async def results_async(self, timeout_s=None, return_exceptions=False):
        await asyncio.Event().wait()


def test_without_rays_per_replica_step_a_frozen_replica_times_the_whole_broadcast_out(short_timeout, caplog):
    class Handle:
        def broadcast(self, method, *args):
            return FrozenPublicResponse()
    start = time.monotonic()
    assert asyncio.run(remote.broadcast(Handle(), "metrics")) == []   # no answer kept: the degraded mode
    assert time.monotonic() - start < 10 * remote.REPLICA_TIMEOUT_S
    assert "no engine replica to call metrics on (TimeoutError" in caplog.text


@pytest.mark.ray
def test_rays_broadcast_response_still_has_the_per_replica_step():
    """`remote._replica_results` uses this private step of Ray 2.60 (no public call waits on each
    replica on its own): a Ray without it falls back to the public call (tested above); this
    says when an upgrade removed or changed it."""
    import inspect
    handle = pytest.importorskip("ray.serve.handle")
    replica_result = pytest.importorskip("ray.serve._private.replica_result")
    step = getattr(handle.DeploymentBroadcastResponse, "_fetch_replica_results_async", None)
    assert step is not None and inspect.iscoroutinefunction(step)
    assert list(inspect.signature(step).parameters) == ["self"]
    assert inspect.iscoroutinefunction(replica_result.ReplicaResult.get_async)


def test_health_counts_the_replicas_running_now_without_a_scrape():
    a, b = FakeReplica("a"), FakeReplica("b")
    handle = FakeHandle(a, b)
    router = FakeRouter(handle.app_name, {"a": a, "b": b})
    adapter.register_router(router)

    async def main():
        async with _ingress(handle) as http:
            assert (await http.get("/health")).json() == {"status": "ok", "model": "tiny", "policy": "pbkv",
                                                          "replicas": 2}
            del router.curr_replicas["b"]                  # Ray's controller saw b die
            assert (await http.get("/health")).json()["replicas"] == 1
            router.curr_replicas["c"] = FakeReplica("c")   # and brought up its replacement
            assert (await http.get("/health")).json()["replicas"] == 2
    asyncio.run(main())
    assert a.calls == b.calls == 0                         # /health asked no replica


def test_ending_a_workflow_elsewhere_in_the_background_never_raises(short_timeout, caplog):
    handle = FakeHandle(FakeReplica("a"))
    handle.error = Unavailable("gone")
    worker = remote.RemoteWorker(handle, 16, None, None)

    async def main():
        worker._end_elsewhere("w")
        await asyncio.gather(*worker._background)
        with pytest.raises(APIError) as err:
            await worker.end_workflow("w")
        assert err.value.status == 503
    asyncio.run(main())
    assert "no engine replica to call end_workflow on (Unavailable" in caplog.text


@pytest.mark.ray
def test_rays_own_unavailable_error_is_taken_as_no_replica(short_timeout):
    exceptions = pytest.importorskip("ray.serve.exceptions")
    from ray.serve._private.common import DeploymentID
    handle = FakeHandle(FakeReplica("a"))
    handle.error = exceptions.DeploymentUnavailableError(DeploymentID(name="PBKVEngine", app_name="pbkv"))
    assert asyncio.run(remote.broadcast(handle, "metrics")) == []


def test_merging_after_every_replica_is_gone_keeps_each_counter_once():
    merger = Merger()
    m = Metrics()
    m.prompt_tokens.inc(9)
    merger.merge("", {"a": m.exposition().decode()})
    for _ in range(3):
        assert parse(merger.merge("", {}).decode())["pbkv_prompt_tokens_total"] == 9


# ---------------------------------------------------------------------- the layout a local Ray can place

def test_a_local_ray_refuses_more_gpus_than_the_machine_has():
    assert gpus_needed(2, 0) == 0 and gpus_needed(2, 1) == 2 and gpus_needed(3, 0.5) == 2
    assert gpus_needed(3, 1 / 3) == 1 and gpus_needed(4, 0.6) == 4      # 0.6 + 0.6 does not fit one GPU
    with pytest.raises(ValueError, match="needs 2 GPUs, and this machine has 0"):
        check_local(ReplicaOptions(replicas=2, replica_gpus=1), cpus=8, gpus=0)
    with pytest.raises(ValueError, match="needs 2 GPUs, and this machine has 1"):
        check_local(ReplicaOptions(replicas=3, replica_gpus=0.5), cpus=8, gpus=1)
    check_local(ReplicaOptions(replicas=2, replica_gpus=0.5), cpus=8, gpus=1)
    check_local(ReplicaOptions(replicas=2), cpus=1, gpus=0)


def test_a_local_ray_refuses_absurd_replica_counts():
    from pbkv.scale.options import MAX_REPLICAS_PER_CPU
    check_local(ReplicaOptions(replicas=2 * MAX_REPLICAS_PER_CPU), cpus=2, gpus=0)
    with pytest.raises(ValueError, match="--replicas 1000 is more than a local Ray on 2 CPU cores runs"):
        check_local(ReplicaOptions(replicas=1000), cpus=2, gpus=0)


@pytest.mark.parametrize("args, message", [(["--replica-gpus", "1"], "needs 2 GPUs"),
                                           (["--replicas", "1000"], "--replicas 1000 is more than")])
def test_pbkv_serve_refuses_them_at_start(monkeypatch, args, message):
    from typer.testing import CliRunner

    import pbkv.scale.options as options
    from pbkv.cli import app
    monkeypatch.setattr(options, "local_machine", lambda: (2, 0))
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", *args])
    assert r.exit_code == 2 and message in " ".join(r.output.replace("│", " ").split()), r.output


def test_pbkv_serve_checks_the_layout_once_and_passes_the_health_options(monkeypatch):
    """The CLI checks the layout before it imports Ray, and tells `serve_app.run` it did (so
    `start_ray` does not check it again); the health options reach `ReplicaOptions`."""
    import sys
    import types

    from typer.testing import CliRunner

    import pbkv.scale.options as options
    from pbkv.cli import app
    checks, runs = [], []
    monkeypatch.setattr(options, "local_machine", lambda: (2, 0))
    real = options.check_local
    monkeypatch.setattr(options, "check_local", lambda *a: checks.append(a) or real(*a))
    fake = types.ModuleType("pbkv.scale.serve_app")   # no Ray: what the CLI hands to serve_app.run
    fake.run = lambda cfg, opts, log_level, layout_checked=False: runs.append((opts, layout_checked))
    monkeypatch.setitem(sys.modules, "pbkv.scale.serve_app", fake)
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", "0", "--health-check-period", "1.5",
                                 "--health-check-timeout", "2", "--engine-stall", "5"])
    assert r.exit_code == 0, r.output
    [(opts, layout_checked)] = runs
    assert len(checks) == 1 and layout_checked
    assert (opts.health_check_period_s, opts.health_check_timeout_s, opts.engine_stall_s) == (1.5, 2, 5)
    reached = []   # with a cluster address: checked once, by the CLI, and serve_app told so
    monkeypatch.setattr(options, "check_reachable", reached.append)
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", "0", "--ray-address", "10.0.0.1:6379"])
    assert r.exit_code == 0, r.output
    assert reached == ["10.0.0.1:6379"] and runs[-1][1] is True


@pytest.mark.parametrize("field", ["health_check_period_s", "health_check_timeout_s", "engine_stall_s"])
def test_health_options_must_be_positive(field):
    from pbkv.scale.options import check_options
    with pytest.raises(ValueError, match=f"--{field[:-2].replace('_', '-')} must be > 0"):
        check_options(ReplicaOptions(**{field: 0}))


@pytest.mark.ray
def test_start_ray_checks_the_layout_unless_its_caller_did(monkeypatch):
    pytest.importorskip("ray")
    from pbkv.scale import serve_app
    checks = []
    monkeypatch.setattr(serve_app, "local_machine", lambda: (2, 0))
    monkeypatch.setattr(serve_app, "check_local", lambda *a: checks.append(a))
    monkeypatch.setattr(serve_app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve_app.ray, "init", lambda **kw: None)
    monkeypatch.delenv(serve_app.FORCE_STOP_ENV, raising=False)
    assert serve_app.start_ray(ReplicaOptions(), layout_checked=True) and checks == []
    assert os.environ[serve_app.FORCE_STOP_ENV] == "1"   # a local Ray stops an unhealthy replica at once
    assert serve_app.start_ray(ReplicaOptions()) and len(checks) == 1   # a direct caller keeps the check
    reached = []
    monkeypatch.setattr(serve_app, "check_reachable", reached.append)
    cluster = ReplicaOptions(ray_address="10.0.0.1:6379")
    assert serve_app.start_ray(cluster, layout_checked=True) and reached == []   # pbkv serve checked it
    assert serve_app.start_ray(cluster) and reached == ["10.0.0.1:6379"]
    monkeypatch.setenv(serve_app.FORCE_STOP_ENV, "0")
    serve_app.start_ray(ReplicaOptions())
    assert os.environ[serve_app.FORCE_STOP_ENV] == "0"   # the operator's own setting wins


@pytest.mark.ray
def test_the_deployment_gets_the_health_options():
    pytest.importorskip("ray")
    from pbkv.scale.serve_app import engine_app
    app = engine_app(ServeConfig(model="tiny"), ReplicaOptions(health_check_period_s=1.5, health_check_timeout_s=2.5,
                                                               engine_stall_s=4))
    deployment = app._bound_deployment
    config = deployment._deployment_config
    assert (config.health_check_period_s, config.health_check_timeout_s) == (1.5, 2.5)
    assert deployment.init_args[1:] == (4,)   # EngineReplica's engine_stall_s


# ---------------------------------------------------------------------- a replica's --disk-dir subfolder

def test_a_replica_removes_the_disk_subfolder_it_created(tmp_path):
    import dataclasses

    from pbkv.cache import CacheConfig
    from pbkv.scale.replica import start_engine, stop_engine
    cfg = ServeConfig(model="tiny", online=False, cache=CacheConfig(device_tokens=4096, disk_dir=str(tmp_path)))
    state, own = start_engine(cfg, "r1")
    assert own.path == str(tmp_path / "replica-r1") and any((tmp_path / "replica-r1").iterdir())
    assert (tmp_path / "replica-r1.lock").is_file()        # its claim, for the life of the replica
    stop_engine(state, own)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "replica-r2").mkdir()                       # there before: not pbkv's to remove
    state, own = start_engine(cfg, "r2")
    stop_engine(state, own)
    assert own is None and (tmp_path / "replica-r2").is_dir()
    assert disk.sweep(str(tmp_path)) == [] and (tmp_path / "replica-r2").is_dir()   # no claim: never swept
    no_disk = dataclasses.replace(cfg, cache=CacheConfig(device_tokens=4096))
    state, own = start_engine(no_disk, "r3")
    stop_engine(state, own)
    assert own is None


CLAIM_AND_HANG = """
import os, sys
from pbkv.scale import disk
fd = disk.claim(sys.argv[1], sys.argv[2])
os.makedirs(os.path.join(disk.folder(sys.argv[1], sys.argv[2]), "store"))
open(os.path.join(disk.folder(sys.argv[1], sys.argv[2]), "store", "block.kv"), "wb").write(b"x" * 4096)
print("claimed", flush=True)
sys.stdin.read()   # until killed
"""


def _killed_owner(parent, replica_id: str) -> None:
    """A replica process that claimed and filled its subfolder, then was SIGKILLed."""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HANG, str(parent), replica_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"claimed\n"
    assert disk.sweep(str(parent)) == []                   # alive: its lock is held, nothing removed
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdin.close()
    proc.stdout.close()


def test_a_new_replica_removes_the_subfolder_of_one_killed_before_its_shutdown(tmp_path):
    from pbkv.cache import CacheConfig
    from pbkv.scale.replica import start_engine, stop_engine
    _killed_owner(tmp_path, "dead")
    assert (tmp_path / "replica-dead" / "store" / "block.kv").is_file()   # left behind by the kill
    live = disk.claim(str(tmp_path), "live")                # a running replica (this process holds its lock)
    (tmp_path / "replica-live").mkdir()
    cfg = ServeConfig(model="tiny", online=False, cache=CacheConfig(device_tokens=4096, disk_dir=str(tmp_path)))
    state, own = start_engine(cfg, "new")
    try:
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["replica-live", "replica-live.lock", "replica-new", "replica-new.lock"], names
    finally:
        stop_engine(state, own)
        disk.release(str(tmp_path), "live", live)


def test_a_sweep_is_bounded_and_leaves_other_hosts_and_foreign_folders(tmp_path, caplog):
    import logging
    for i in range(5):
        (tmp_path / f"replica-gone{i}").mkdir()
        (tmp_path / f"replica-gone{i}.lock").write_text(f"{socket.gethostname()} 1\n")   # owner gone
    (tmp_path / "replica-far").mkdir()
    (tmp_path / "replica-far.lock").write_text("another-node 7\n")   # its lock may live on another node
    (tmp_path / "replica-old").mkdir()                               # no claim: not made by this code
    with caplog.at_level(logging.INFO, logger="pbkv.scale"):
        assert [os.path.basename(p) for p in disk.sweep(str(tmp_path), limit=3)] == [
            "replica-gone0", "replica-gone1", "replica-gone2"]
    assert "removed " + str(tmp_path / "replica-gone0") in caplog.text
    assert "the rest wait for the next replica start" in caplog.text
    assert len(disk.sweep(str(tmp_path))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica-far", "replica-far.lock", "replica-old"]
    assert disk.sweep(str(tmp_path / "missing")) == []      # no disk dir yet: nothing to do, no error


# ---------------------------------------------------------------------- for real: a local Ray, one replica

@pytest.mark.ray
def test_with_the_deployment_gone_the_ingress_still_answers_metrics_health_and_end(tmp_path):
    """One `tiny` replica on a local Ray, then its app deleted under the running ingress: Ray's
    handle then raises DeploymentUnavailableError on every broadcast, as with every replica dead."""
    import os
    import tempfile
    from pathlib import Path

    pytest.importorskip("ray")
    from ray import serve

    from pbkv.cache import CacheConfig
    from pbkv.scale.serve_app import ReplicaServer
    src = str(Path(__file__).resolve().parent.parent / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])  # the replica imports this pbkv
    cfg = ServeConfig(model="tiny", port=0, threads=1, cache=CacheConfig(device_tokens=4096), api_key=KEY,
                      default_max_tokens=4)
    opts = ReplicaOptions(replicas=1, app_name="pbkv-gone", stats_period_s=0.5)
    srv = ReplicaServer(cfg, opts, log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="pbkvray")).start()
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
            body = {"model": "tiny", "prompt": "count me", "workflow_id": "w1"}
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.get("/health").json()["replicas"] == 1
            before = parse(http.get("/metrics").text)
            assert before["pbkv_replicas"] == 1 and before["pbkv_prompt_tokens_total"] > 0
            serve.delete(opts.app_name)
            deadline = time.monotonic() + 30
            while http.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["replicas"] == 0
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            after = parse(metrics.text)
            assert after["pbkv_replicas"] == 0
            assert after["pbkv_prompt_tokens_total"] == before["pbkv_prompt_tokens_total"]
            end = http.post("/v1/workflows/w1/end")
            assert end.status_code == 503 and end.json()["error"]["code"] == "replicas_unavailable"
            assert http.get("/health").status_code == 503        # the same kept-alive connection still serves
    finally:
        srv.stop()


def test_past_its_bound_the_ingress_forgets_the_workflow_idle_longest(monkeypatch):
    """It cleared every workflow at once, the running ones too (they then ended on the other
    replicas only by idle timeout)."""
    from pbkv.engine.sampling import Sampling
    from pbkv.serve.jobs import Job
    from pbkv.serve.workflows import Hints
    monkeypatch.setattr(remote, "MAX_VISITED", 3)
    worker = remote.RemoteWorker(FakeHandle(FakeReplica("a")), 16, None, None)
    for wid, replica in [("w1", "a"), ("w2", "a"), ("w3", "b"), ("w1", "b"), ("w4", "a")]:
        flow = worker._open(Job([1], Sampling(max_new_tokens=1), Hints(wid)))
        worker._placed_on(flow, replica, done=False)
        worker._close(flow, wid)                  # the call finished: the flow is idle
    got = {wid: flow.replicas for wid, flow in worker.visited.items()}
    assert got == {"w3": {"b"}, "w1": {"a", "b"}, "w4": {"a"}}   # w2 idle longest; w1 called again
    busy = worker._open(Job([1], Sampling(max_new_tokens=1), Hints("w5")))   # in flight: never forgotten
    for wid in ("w6", "w7", "w8"):
        worker._close(worker._open(Job([1], Sampling(max_new_tokens=1), Hints(wid))), wid)
    assert worker.visited.get("w5") is busy and len(worker.visited) == 3
