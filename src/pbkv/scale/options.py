"""`pbkv serve --replicas` layout options and their checks: no Ray here, so a bad option is refused
(with its reason) even where the `scale` extra is not installed."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

# a local Ray: each replica is a process holding the model, so more than this many per CPU core is
# a mistake (Ray would be started with the CPUs inflated to fit them: `serve_app.start_ray`)
MAX_REPLICAS_PER_CPU = 4


@dataclass
class ReplicaOptions:
    """How the engine deployment is laid out (the rest is `ServeConfig`, shared by every replica)."""

    replicas: int = 2
    router: str = "pbkv"
    router_config: dict | None = None   # RouterConfig fields; None: CPU costs without CUDA, else defaults
    ray_address: str | None = None      # None: a local Ray started (and stopped) here
    app_name: str = "pbkv"
    stats_period_s: float = 1.0         # how often each replica reports its cache to the router
    measured_costs: bool = False        # the router's prefill/transfer costs follow the replicas' reports
    replica_cpus: float = 1.0           # Ray CPUs reserved per replica
    replica_gpus: float = 0.0
    # a frozen or stuck replica is stopped (and its calls retried) about `period + 3 x timeout`
    # after its last good check (Ray fails it after 3 checks in a row): ~11 s by default, where
    # Ray's own defaults (10 s, 30 s, then a 30 s graceful stop) take ~130 s
    health_check_period_s: float = 2.0  # how often Ray's controller calls each replica's check_health
    health_check_timeout_s: float = 3.0  # a check not answered by then failed (a SIGSTOPped process)
    engine_stall_s: float = 8.0         # check_health fails once the engine thread left work unanswered this long


def check_options(opts: ReplicaOptions) -> None:
    """Refuse a bad layout before Ray starts (ValueError, with the known router names)."""
    from pbkv.route import router_class
    router_class(opts.router)
    if opts.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {opts.replicas}")
    for name in ("health_check_period_s", "health_check_timeout_s", "engine_stall_s"):
        if not getattr(opts, name) > 0:
            raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0, got {getattr(opts, name)}")
    if (opts.ray_address or "").startswith("ray://"):
        raise ValueError(f"--ray-address {opts.ray_address}: Ray Client (ray://) cannot stream from deployments, "
                         f"which every call does; run pbkv serve on a node of the cluster with --ray-address auto")


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Refuse a `--ray-address HOST:PORT` where nothing accepts a connection (ValueError): Ray
    itself retries such an address for minutes, silently. `auto`, `local` and None are Ray's to
    resolve (a missing cluster fails there at once)."""
    if not address or address in ("auto", "local"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--ray-address {address}: expected auto or the head's HOST:PORT (GCS port, 6379 by default)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: nothing answers there ({e.strerror or e}); start the cluster's "
                         f"head first (ray start --head) or give its GCS address") from None


def gpus_needed(replicas: int, per_replica: float) -> float:
    """GPUs Ray needs to place `replicas` replicas of `per_replica` GPUs each: with a fraction, a
    GPU holds floor(1 / fraction) of them (Ray never spreads one replica over two GPUs)."""
    if per_replica <= 0:
        return 0
    if per_replica < 1:
        return math.ceil(replicas / math.floor(1 / per_replica + 1e-9))   # 1e-9: 1 / (1/3) may be 2.999...
    return replicas * per_replica


def local_machine() -> tuple[int, int]:
    """(CPU cores, CUDA GPUs) of this machine: what a local Ray started here can place replicas on.
    The GPUs are torch's count, the replicas' engines use torch."""
    import torch
    return os.cpu_count() or 1, torch.cuda.device_count()


def check_local(opts: ReplicaOptions, cpus: int, gpus: int) -> None:
    """Refuse a layout that a local Ray on a machine of `cpus` cores and `gpus` GPUs could never
    place (Ray would wait for it forever, silently) or that is surely a typo (ValueError)."""
    most = MAX_REPLICAS_PER_CPU * cpus
    if opts.replicas > most:
        raise ValueError(f"--replicas {opts.replicas} is more than a local Ray on {cpus} CPU cores runs ({most}: "
                         f"{MAX_REPLICAS_PER_CPU} per core, each replica loads the model); join a cluster with "
                         f"--ray-address for more")
    need = gpus_needed(opts.replicas, opts.replica_gpus)
    if need > gpus:
        raise ValueError(f"--replicas {opts.replicas} with --replica-gpus {opts.replica_gpus:g} needs {need:g} GPUs, "
                         f"and this machine has {gpus}: Ray would wait forever to place them; use fewer, or join "
                         f"a cluster that has them with --ray-address")
