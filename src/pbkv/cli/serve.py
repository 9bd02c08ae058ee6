"""`pbkv serve`: the OpenAI-compatible server (pbkv.serve does the work)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from pbkv.cli.common import (DeviceTokensOpt, DiskTokensOpt, HostTokensOpt, ModelOpt, OnlineOpt, PolicyOpt,
                             PredictorOpt, RouterOpt, ThreadsOpt, written_path, console, exit_on_error, fail, output_folder,
                             readable_folder)


# options that act only with --replicas > 1: named in a warning when given with --replicas 1
REPLICA_ONLY = ("router", "ray_address", "measured_costs", "replica_cpus", "replica_gpus", "health_check_period",
                "health_check_timeout", "engine_stall")
PORT_TAKEN = 3   # the exit status of uvicorn (the single-process server) when it cannot bind the port


def given(ctx: typer.Context, names) -> list[str]:
    """The options among `names` (parameter names) the user gave (command line or environment),
    as `--flags`, in `names`' order. Sources compared by name: typer may bring its own copy of
    click, whose `ParameterSource` is not `click.core`'s."""
    out = []
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            out.append("--" + name.replace("_", "-"))
    return out


def check_port(host: str, port: int) -> None:
    """Raises OSError when `host:port` cannot be bound now, tried as uvicorn binds it (IPv6 for a
    host with ':', SO_REUSEADDR): with --replicas, before Ray and the replicas start (tens of
    seconds) rather than when the ingress's uvicorn binds it after them. Port 0 (any free one)
    always binds."""
    if port == 0:
        return
    with socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


def serve(
    ctx: typer.Context,
    model: ModelOpt = "tiny",
    policy: PolicyOpt = "pbkv",
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default; set --api-key before exposing it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", min=0, max=65535)] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="Require 'Authorization: Bearer KEY' (env PBKV_API_KEY).",
                                           envvar="PBKV_API_KEY")] = None,
    served_name: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the model's name).")] = None,
    record: Annotated[Optional[Path], typer.Option(
        help="Write served calls as traces (docs/trace-format.md) into this folder.", callback=output_folder, parser=written_path)] = None,
    record_rotate: Annotated[int, typer.Option(help="Calls per trace file before the next one starts.", min=1)] = 10_000,
    record_context: Annotated[bool, typer.Option(help="Also record each call's latest message (as `context`).")] = False,
    predictor: PredictorOpt = None,
    online: OnlineOpt = True,
    learn_every: Annotated[int, typer.Option(help="Retrain after this many ended workflows.", min=1)] = 50,
    learn_steps: Annotated[int, typer.Option(help="Optimiser steps per retrain.", min=1)] = 300,
    learn_nice: Annotated[int, typer.Option(help="Niceness of the retrain process (0: an equal CPU share; it slows serving "
                                    "while it runs).", min=0, max=19)] = 10,
    idle_timeout: Annotated[float, typer.Option(help="Seconds without calls after which a workflow ends.", min=0.001)] = 300.0,
    device_tokens: DeviceTokensOpt = None,
    host_tokens: HostTokensOpt = None,
    disk_tokens: DiskTokensOpt = None,
    disk_dir: Annotated[Optional[Path], typer.Option(
        help="Folder for disk-tier KV files: the server writes them in a subfolder of its own there, removed at "
             "shutdown (default: the system temp folder).", callback=output_folder, parser=written_path)] = None,
    shared_dir: Annotated[Optional[Path], typer.Option(help="Folder of KV blocks shared with other pbkv servers of the same "
                                               "model (read after the local tiers, written after each prefill; "
                                               "default: none; a folder this server cannot write is only read, with a "
                                               "warning).", callback=readable_folder, parser=written_path)] = None,
    shared_bytes: Annotated[Optional[int], typer.Option(help="Bound of --shared-dir in bytes (least recently used files "
                                                "go first, down to 90%; holds with up to 4 servers writing "
                                                "the folder, each more may add 1/40; default 8 GiB).", min=1)] = None,
    max_tokens_limit: Annotated[int, typer.Option(help="Largest max_tokens a request may ask for.", min=1)] = 1024,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request gives none.", min=1)] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body.", min=1)] = 1 << 20,
    max_queue: Annotated[int, typer.Option(help="Requests in flight before new ones get 429.", min=1)] = 1024,
    max_connections: Annotated[int, typer.Option(help="Open connections (and requests) before new requests get 503.",
                                                 min=1)] = 2048,
    max_agents: Annotated[int, typer.Option(help="Distinct agent names kept for the server's life; later new ones "
                                            "are agent 'other' (bounds what clients' made-up names can take).",
                                            min=1)] = 256,
    header_timeout: Annotated[float, typer.Option(help="Seconds a client has to send a request's headers (from "
                                                  "connecting, or from its first byte on a kept-alive connection) "
                                                  "before the connection is closed.", min=0.001)] = 10.0,
    body_timeout: Annotated[float, typer.Option(help="Seconds a client has to send a request's whole body "
                                                "(after its headers) before it gets 408.", min=0.001)] = 30.0,
    keep_alive: Annotated[float, typer.Option(help="Seconds an idle kept-alive connection stays open.",
                                              min=0.001)] = 5.0,
    threads: ThreadsOpt = 1,
    replicas: Annotated[int, typer.Option(help="Engine replicas. 1: this process serves alone (no Ray). N > 1: N "
                                          "replicas on Ray Serve (each with this command's model, cache and "
                                          "policy settings) behind --router; needs the scale extra.",
                                          min=1)] = 1,
    router: RouterOpt = None,
    ray_address: Annotated[Optional[str], typer.Option(help="With --replicas > 1: join this Ray cluster (auto, or "
                                                       "its GCS address host:6379; from a node of the cluster) "
                                                       "instead of starting a local Ray.")] = None,
    replica_cpus: Annotated[float, typer.Option(help="With --replicas > 1: Ray CPUs reserved per replica.",
                                                min=0)] = 1.0,
    replica_gpus: Annotated[float, typer.Option(help="With --replicas > 1: Ray GPUs per replica (a local Ray "
                                                "refuses more than this machine has).", min=0)] = 0.0,
    measured_costs: Annotated[bool, typer.Option(help="With --replicas > 1: the router weighs the prefill and "
                                                 "KV-transfer costs the replicas measure and report, instead of "
                                                 "fixed estimates (CPU costs without CUDA, GPU defaults with).")] = False,
    health_check_period: Annotated[float, typer.Option(help="With --replicas > 1: seconds between Ray's health checks "
                                                       "of each replica.", min=0.001)] = 2.0,
    health_check_timeout: Annotated[float, typer.Option(help="With --replicas > 1: a replica that has not answered a "
                                                        "health check within this many seconds (a frozen process) "
                                                        "failed it; 3 failures in a row and Ray replaces it, its "
                                                        "calls go to another replica.", min=0.001)] = 3.0,
    engine_stall: Annotated[float, typer.Option(help="With --replicas > 1: a replica whose engine thread has left "
                                                "work unanswered this many seconds (stuck) fails its health "
                                                "checks.", min=0.001)] = 8.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /metrics) on the real
    engine, with workflow hints (workflow_id, agent, workflow_done; X-Workflow-Id, X-Agent)."""
    try:
        from pbkv.serve import ServeConfig, run
    except ImportError as e:
        fail(f"pbkv serve needs the serve extra ({e.name} is missing): pip install 'pbkv[serve]'")
    from pbkv.cache import CacheConfig
    if api_key is None and os.environ.get("PBKV_API_KEY") == "":  # click reads an empty variable as unset
        api_key = ""                                               # refused below, with the flag's message
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(f"[yellow]warning:[/yellow] binding {escape(host)} without --api-key: anyone who reaches it can use it")
    # absolute paths (here and below): with --replicas the engines run in Ray workers, whose working
    # folder is not this one
    cache = CacheConfig(device_tokens, host_tokens, disk_tokens,
                        disk_dir=str(disk_dir.resolve()) if disk_dir else None,
                        shared_dir=str(shared_dir.resolve()) if shared_dir else None, shared_bytes=shared_bytes)
    with exit_on_error():
        cache.check()   # a disk below --host-tokens 0 is never used: refused before the model loads
    if model not in ("tiny", "smollm2") and Path(model).exists():   # a local folder (a built-in name wins,
        model = os.path.abspath(model)                              # as in load_model): absolute, as above
    cfg = ServeConfig(model=model, policy=policy, host=host, port=port, api_key=api_key, served_name=served_name,
                      cache=cache, record=os.path.abspath(record) if record else None, record_rotate=record_rotate,
                      record_context=record_context, predictor_dir=os.path.abspath(predictor) if predictor else None,
                      online=online, learn_every=learn_every, learn_steps=learn_steps, learn_nice=learn_nice,
                      idle_timeout=idle_timeout, max_tokens_limit=max_tokens_limit,
                      default_max_tokens=default_max_tokens, max_body_bytes=max_body_bytes, max_queue=max_queue,
                      max_connections=max_connections, max_agents=max_agents, header_timeout=header_timeout, body_timeout=body_timeout,
                      keep_alive=keep_alive, threads=threads)
    if replicas == 1:
        ignored = given(ctx, REPLICA_ONLY)
        if ignored:
            names = ignored[0] if len(ignored) == 1 else ", ".join(ignored[:-1]) + " and " + ignored[-1]
            console.print(f"[yellow]warning:[/yellow] {names} appl{'ies' if len(ignored) == 1 else 'y'} only with "
                          "--replicas > 1 (ignored: this process serves alone)")
        with exit_on_error():
            state = run(cfg, log_level=log_level)
        if state is not None and state.setup.save_error:   # already logged as one error line at shutdown
            raise typer.Exit(1)
        return
    from pbkv.scale.options import ReplicaOptions, check_local, check_options, check_reachable, local_machine
    opts = ReplicaOptions(replicas=replicas, router=router or "pbkv", ray_address=ray_address, replica_cpus=replica_cpus,
                          replica_gpus=replica_gpus, measured_costs=measured_costs,
                          health_check_period_s=health_check_period, health_check_timeout_s=health_check_timeout,
                          engine_stall_s=engine_stall)
    with exit_on_error():
        check_options(opts)          # before the Ray import: a bad option is refused with or without Ray
        if ray_address is None:
            check_local(opts, *local_machine())
    try:
        check_port(host, port)       # before Ray and the replicas start (tens of seconds), not after
    except OSError as e:
        why = ("another server may be using it; choose another --port" if e.errno == errno.EADDRINUSE
               else "check --host: it must be an address of this machine")   # unknown name, foreign address
        fail(f"cannot bind {host}:{port} ({e.strerror or e}): {why}", code=PORT_TAKEN)
    if ray_address is not None:
        with exit_on_error():
            check_reachable(ray_address)   # Ray would retry an unreachable address for minutes
    try:
        from pbkv.scale.serve_app import run as run_replicas
    except ImportError as e:
        fail(f"pbkv serve --replicas needs the scale extra ({e.name} is missing): pip install 'pbkv[scale]'")
    with exit_on_error():
        save_errors = run_replicas(cfg, opts, log_level=log_level, layout_checked=True)   # checked above
    if save_errors:   # each already logged as one error line by its replica
        raise typer.Exit(1)
