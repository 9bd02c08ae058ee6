"""`pbkv serve --replicas` layout options and their checks: no Ray here, so a bad option is refused
(with its reason) even where the `scale` extra is not installed."""

from __future__ import annotations

from dataclasses import dataclass


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


def check_options(opts: ReplicaOptions) -> None:
    """Refuse a bad layout before Ray starts (ValueError, with the known router names)."""
    from pbkv.route import router_class
    router_class(opts.router)
    if opts.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {opts.replicas}")
    if (opts.ray_address or "").startswith("ray://"):
        raise ValueError(f"--ray-address {opts.ray_address}: Ray Client (ray://) cannot stream from deployments, "
                         f"which every call does; run pbkv serve on a node of the cluster with --ray-address auto")
