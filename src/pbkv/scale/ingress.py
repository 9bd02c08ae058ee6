"""The ingress of `pbkv serve --replicas N`: the app's `ServerState` in front of the engine
deployment behind a Ray Serve handle. Its engine is a `RemoteWorker` (`pbkv.scale.remote`), its
/metrics merges what the replicas answer (`pbkv.scale.metrics_merge`, with the ingress's own
figures and `pbkv_replicas`, the replicas that answered), its /health counts the replicas running.
No Ray import here (unit-tested with fake handles); `pbkv.scale.serve_app` starts Ray and the
deployment, then calls `ingress_state`.

/health: `replicas` is the deployment's running replicas as this process's router knows them at
that moment (`adapter.running_replicas`: Ray's controller keeps it current; no call to a replica,
so a stuck one cannot make a probe hang). With none it is a 503 (`status` "unavailable", and
Retry-After), so a load balancer probing /health stops sending traffic here meanwhile.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from pbkv.scale.adapter import running_replicas
from pbkv.scale.handoff import learn_left_over, pooled
from pbkv.scale.metrics_merge import SERVED, Merger
from pbkv.scale.remote import RETRY_AFTER_S, RemoteWorker, broadcast
from pbkv.serve.app import ServerState
from pbkv.serve.errors import APIError
from pbkv.serve.metrics import Metrics
from pbkv.serve.server import ServeConfig


class ReplicasDown(APIError):
    """/health's answer when no engine replica runs: 503, its body /health's own fields (`status`
    "unavailable", `replicas` 0) with the OpenAI `error` next to them."""

    def __init__(self, fields: dict):
        super().__init__(503, "No engine replica is running (Ray may be restarting them); retry later.",
                         "server_error", None, "replicas_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.fields = fields

    def body(self) -> dict:
        return {"status": "unavailable"} | self.fields | super().body()


def health(state: ServerState, running: int | None) -> dict:
    """/health's extra field `replicas` (`running`; None, no router to ask, counts as none);
    raises `ReplicasDown` when there are none."""
    if not running:
        raise ReplicasDown({"model": state.model_name, "policy": state.policy_name, "replicas": 0})
    return {"replicas": running}


STOP_TIMEOUT_S = 300.0   # a replica's shutdown may train and save its predictor first


def stop_replicas(handle, cfg: ServeConfig, block_size: int, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """Every replica's shutdown (`EngineReplica.stop`), before the deployment is deleted, then a
    predictor trained on the workflows they had too few of (`pbkv.scale.handoff`): the predictor
    save errors (a replica that did not answer in time is logged, and stops when the deployment
    is deleted)."""
    answers = asyncio.run(broadcast(handle, "stop", timeout_s=timeout_s))
    errors, left = pooled(answers)
    error = learn_left_over(cfg, block_size, left)
    return errors + ([error] if error else [])


def wait_for_replicas(handle, replicas: int, timeout: float = 120.0) -> list[dict]:
    """Every replica's `info()`, once the handle's router knows all `replicas` of them."""
    deadline = time.monotonic() + timeout
    while True:
        infos = handle.broadcast("info").results(timeout_s=max(1.0, deadline - time.monotonic()))
        if len(infos) >= replicas or time.monotonic() > deadline:
            return infos
        time.sleep(0.1)   # the router learns of the replicas from Ray's controller shortly after serve.run


def ingress_state(cfg: ServeConfig, handle, replicas: int) -> ServerState:
    """The app's state for an ingress in front of the deployment behind `handle`."""
    infos = wait_for_replicas(handle, replicas)
    if not infos:
        raise RuntimeError("no engine replica answered")
    info = infos[0]
    metrics = Metrics()
    retried = Counter("pbkv_replica_retried_requests_total", "Calls sent again to another replica because "
                      "theirs was lost before any text reached the client.", registry=metrics.registry)
    failed = Counter("pbkv_replica_failed_requests_total", "Calls ended with a replica_failed error: their "
                     "replica was lost mid-stream, or again on the retry.", registry=metrics.registry)
    worker = RemoteWorker(handle, info["block_size"], retried, failed,
                          running=lambda: running_replicas(handle.app_name), metrics=metrics)
    state = ServerState(model_name=info["model_name"], policy_name=info["policy"], tokenizer=info["tokenizer"],
                        worker=worker, metrics=metrics, max_context=info["max_context"], config=cfg)
    merger = Merger(own_totals=SERVED)   # served tokens counted here; other counters: each replica's last

    async def exposition() -> bytes:
        texts = dict(await broadcast(handle, "metrics"))   # (replica id, its text) of those that answered
        live = GaugeMetricFamily("pbkv_replicas", "Engine replicas that answered this scrape.", value=len(texts))
        return merger.merge(metrics.exposition().decode(), texts, [live])

    state.exposition = exposition
    state.health = lambda: health(state, running_replicas(handle.app_name))
    return state
