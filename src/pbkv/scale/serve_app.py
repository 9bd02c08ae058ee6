"""`pbkv serve --replicas N`: the OpenAI API in front of N engine replicas on Ray Serve.

Two parts:
- the engine deployment (`engine_app`): N `EngineReplica`s (`pbkv.scale.replica`), each today's
  engine side built from the same `ServeConfig`, behind pbkv's `PBKVRequestRouter` running the
  router named by `--router` (`pbkv.route` registry); Ray restarts a replica that dies;
- the ingress (`pbkv.scale.ingress.ingress_state`): this process's uvicorn and `pbkv.serve.app`,
  unchanged (the same routes, hints, API key, limits, error shapes), whose worker is a
  `RemoteWorker` (`pbkv.scale.remote`: tokenized calls go to the replica the router picks;
  retries), whose /metrics merges what the replicas answer (`pbkv.scale.metrics_merge`) and whose
  /health counts the replicas running (503 with none).
Why the ingress is this process and not a Ray Serve ingress deployment: it keeps the server's
own connection limits (header/body timeouts, keep-alive, max connections: `serve/limits.py`) and
`--host/--port` exactly, needs no Ray HTTP proxy (started with `proxy_location="Disabled"`,
so nothing else binds a port), and tokenizing is cheap next to generation.

Ray: a local one (`ray.init(address="local")`) unless `ray_address` names a cluster to join
(`auto`, or its GCS address, from a node of the cluster: Ray Client `ray://` addresses cannot
stream from deployments, so they are refused); pbkv must be importable on its nodes.

A frozen or stuck replica: Ray's controller calls each replica's `check_health` every
`health_check_period_s` (a stuck engine thread makes it raise: `pbkv.scale.health`; a frozen
process does not answer within `health_check_timeout_s`) and stops it after 3 failures in a row;
a local Ray started here force-stops it (`RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS=1`: the
graceful stop would wait `graceful_shutdown_timeout_s` for calls that will never end), so its
calls fail over about `period + 3 x timeout` after its last good check.
"""

from __future__ import annotations

import logging
import os
import secrets

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pbkv.scale.ingress import ingress_state, stop_replicas
from pbkv.scale.probe import CPU_COSTS, ROUTER_CLASS
from pbkv.scale.options import ReplicaOptions, check_local, check_options, check_reachable, local_machine
from pbkv.scale.replica import EngineReplica
from pbkv.serve.server import ServeConfig

log = logging.getLogger("pbkv.scale")
DEPLOYMENT = "PBKVEngine"
FORCE_STOP_ENV = "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"   # read by Ray Serve's controller at import


def default_router_config() -> dict:
    import torch
    return {} if torch.cuda.is_available() else dict(CPU_COSTS)


def engine_app(cfg: ServeConfig, opts: ReplicaOptions):
    """The bound engine deployment (give it to `serve.run`)."""
    check_options(opts)
    config = default_router_config() if opts.router_config is None else opts.router_config
    config = {"can_fetch": True} | config   # replicas move KV between them (scale/replica.py)
    router_cfg = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                     request_router_kwargs={"router": opts.router, "config": config,
                                                            "measured_costs": opts.measured_costs},
                                     request_routing_stats_period_s=opts.stats_period_s)
    deployment = serve.deployment(EngineReplica, name=DEPLOYMENT)
    return deployment.options(
        num_replicas=opts.replicas, max_ongoing_requests=cfg.max_queue + 64,   # the ingress bounds the queue
        ray_actor_options={"num_cpus": opts.replica_cpus, "num_gpus": opts.replica_gpus},
        request_router_config=router_cfg, graceful_shutdown_timeout_s=30,
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=opts.health_check_timeout_s).bind(cfg, opts.engine_stall_s)


def start_ray(opts: ReplicaOptions, layout_checked: bool = False, **init_kwargs) -> bool:
    """Connect to Ray (join `ray_address` once `options.check_reachable` finds it answering,
    else start a local one once `options.check_local` accepts the layout on this machine: each
    checked here unless the caller says it did, with `layout_checked`, as `pbkv serve` does
    before it imports Ray); True when started here."""
    if ray.is_initialized():
        return False
    if opts.ray_address:
        if not layout_checked:
            check_reachable(opts.ray_address)   # Ray would retry an unreachable address for minutes
        ray.init(address=opts.ray_address, namespace=f"pbkv-{opts.app_name}", **init_kwargs)
        return True
    cores, gpus = local_machine()
    if not layout_checked:
        check_local(opts, cores, gpus)   # before Ray starts: it would wait forever for what it cannot place
    cpus = max(cores, int(opts.replicas * opts.replica_cpus + 0.999))
    # Ray's processes inherit this process's environment: an operator's own setting wins
    os.environ.setdefault(FORCE_STOP_ENV, "1")
    ray.init(address="local", namespace=f"pbkv-{secrets.token_hex(3)}", num_cpus=cpus,
             include_dashboard=False, **init_kwargs)
    return True


def deploy(cfg: ServeConfig, opts: ReplicaOptions):
    """Start Serve without its HTTP proxy and run the engine deployment; its handle."""
    serve.start(proxy_location="Disabled")
    return serve.run(engine_app(cfg, opts), name=opts.app_name, route_prefix=None)


class ReplicaServer:
    """Ray, the engine deployment and the ingress, started together; `stop()` ends all three (Ray
    only when started here). `server` is the ingress's `ServerThread` (its `url`)."""

    def __init__(self, cfg: ServeConfig, opts: ReplicaOptions, log_level: str = "warning", **ray_init):
        from pbkv.serve.server import ServerThread
        self.opts = opts
        check_options(opts)
        self.own_ray = start_ray(opts, **ray_init)
        self.handle = deploy(cfg, opts)
        self.state = ingress_state(cfg, self.handle, opts.replicas)
        self.server = ServerThread(cfg, log_level=log_level, state=self.state)
        self.url = self.server.url

    def start(self) -> "ReplicaServer":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        shutdown(self.opts.app_name, self.own_ray)

    def __enter__(self) -> "ReplicaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def shutdown(app_name: str, own_ray: bool) -> None:
    try:
        serve.delete(app_name)
    finally:
        if own_ray:
            serve.shutdown()
            ray.shutdown()


def run(cfg: ServeConfig, opts: ReplicaOptions, log_level: str = "info", layout_checked: bool = False) -> list[str]:
    """`pbkv serve --replicas N`: in the foreground until Ctrl-C, then every replica stops (its
    predictor saved) and the deployment is deleted (`layout_checked`: see `start_ray`). The
    replicas' predictor save errors (`pbkv serve` exits 1 when there are any)."""
    from pbkv.serve.server import check_config, run as run_ingress
    check_config(cfg)
    check_options(opts)
    own_ray = start_ray(opts, layout_checked)
    try:
        handle = deploy(cfg, opts)
        state = ingress_state(cfg, handle, opts.replicas)
        log.info("%d engine replicas up behind the %r router", opts.replicas, opts.router)
        run_ingress(cfg, log_level, state=state)
        # uvicorn has finished every call: nothing runs on the replicas now
        errors = stop_replicas(handle, cfg, state.worker.block_size)
        if errors:
            log.error("%d engine replica(s) could not save the predictor: %s", len(errors), "; ".join(errors))
        return errors
    finally:
        shutdown(opts.app_name, own_ray)
