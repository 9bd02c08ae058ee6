"""Building and running a server: `ServeConfig` -> model, cache, policy, engine thread, app.

`run(cfg)` is `pbkv serve` (uvicorn in the foreground until Ctrl-C). `ServerThread` runs the same
app on a background thread, on a socket it already bound (port 0: a free loopback port, no
race), for tests, the benchmark and the examples.
Shutdown order: stop taking requests (uvicorn), stop the engine thread (cancels what runs, ends
every workflow so the policy and the recorder hear it), save the predictor, close the engine. A
forced quit (a second Ctrl-C) only cuts the answers in flight sooner: the later steps still run
(`run_server`).
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pbkv.cache import CacheConfig, Capacities, CapacityDefaults
from pbkv.serve.app import ServerState, create_app
from pbkv.serve.limits import uvicorn_config
from pbkv.serve.metrics import Metrics
from pbkv.serve.workflows import WorkflowTable

log = logging.getLogger("pbkv.serve")
SERVE_CAPACITY = CapacityDefaults(16384, host_ratio=2, disk_ratio=4)  # tokens when --device-tokens etc. are unset


@dataclass
class ServeConfig:
    """Everything `pbkv serve` takes; the one home of its defaults (the app reads its limits
    from here: `ServerState.config`)."""

    model: str = "tiny"                  # tiny | smollm2 | a local model directory
    policy: str = "pbkv"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_name: str | None = None       # the id clients send as `model` (default: the model's name)
    cache: CacheConfig = field(default_factory=CacheConfig)  # unset capacities: SERVE_CAPACITY
    record: str | None = None            # --record DIR
    record_rotate: int = 10_000          # calls per trace file
    record_context: bool = False         # write each call's latest message as `context`
    predictor_dir: str | None = None     # loaded at start (if present), saved on shutdown
    online: bool = True
    learn_every: int = 50                # retrain after this many ended workflows
    learn_steps: int = 300               # optimiser steps per retrain (~6 s on one core for 50 workflows)
    learn_nice: int = 10                 # niceness of the retrain process (0: equal CPU share)
    idle_timeout: float = 300.0
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 1024
    default_max_tokens: int = 256
    max_queue: int = 1024
    max_connections: int = 2048          # open connections + running requests; above: 503 (serve/limits.py)
    header_timeout: float = 10.0         # seconds to send a request's headers (serve/limits.py)
    body_timeout: float = 30.0           # seconds to send a request's body after its headers (408)
    keep_alive: float = 5.0              # seconds an idle kept-alive connection stays open
    max_running: int = 64
    max_agents: int = 256
    threads: int | None = 1              # torch CPU threads (1: fastest for small models, and no
                                         # thread-barrier stalls when other jobs share the cores)
    seed: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def capacities(self) -> Capacities:
        return self.cache.resolve(SERVE_CAPACITY)


def build_state(cfg: ServeConfig) -> ServerState:
    """Load everything; raises ValueError / ModelLoadError with a message for the command line."""
    import torch

    from pbkv.engine.hf import load_model
    from pbkv.serve.learning import build_policy, finish_learning
    from pbkv.serve.recorder import TraceRecorder
    from pbkv.serve.tokenizer import tokenizer_for
    from pbkv.serve.worker import EngineWorker

    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    for name in ("max_tokens_limit", "default_max_tokens", "max_queue", "max_running", "max_body_bytes",
                 "record_rotate", "learn_every", "learn_steps", "max_agents", "max_connections"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.cache.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {cfg.cache.block_size}")
    if cfg.cache.shared_bytes is not None and cfg.cache.shared_bytes < 1:
        raise ValueError(f"--shared-bytes must be >= 1, got {cfg.cache.shared_bytes}")
    block_size = cfg.cache.block_size
    setup = build_policy(cfg.policy, block_size, cfg.predictor_dir, cfg.online, cfg.learn_every,
                         learn_steps=cfg.learn_steps, learn_nice=cfg.learn_nice)
    lm = load_model(cfg.model, seed=cfg.seed)
    tokenizer = tokenizer_for(lm.tokenizer, lm.vocab_size)
    caps = cfg.capacities()
    engine = _engine(cfg, lm, setup.policy, caps, tokenizer.eos_ids)
    table = WorkflowTable(cfg.idle_timeout, max_agents=cfg.max_agents)
    metrics = Metrics()
    name = cfg.served_name or Path(cfg.model).name
    recorder = TraceRecorder(cfg.record, table.session, block_size, name, cfg.record_rotate) if cfg.record else None
    worker = EngineWorker(engine, tokenizer, table, metrics, recorder, cfg.clock, cfg.record_context)
    positions = getattr(lm.model.config, "max_position_embeddings", None) or caps.device
    state = ServerState(model_name=name, policy_name=cfg.policy, tokenizer=tokenizer, worker=worker,
                        metrics=metrics, max_context=min(positions, caps.device), config=cfg)
    state.setup = setup
    worker.learner = setup.learner

    def save_predictor():
        saved = finish_learning(setup)
        if saved is not None:
            log.info("saved the predictor to %s", saved)
    state.on_shutdown += [worker.stop, save_predictor, engine.close]
    worker.start()
    return state


def check_config(cfg: ServeConfig) -> None:
    """Refuse settings that would silently weaken the server (before anything loads)."""
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ValueError("--api-key (or PBKV_API_KEY) is empty: give a non-empty key, or unset it to run "
                         "without authentication")
    for name in ("header_timeout", "body_timeout", "keep_alive"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")


def _engine(cfg: ServeConfig, lm, policy, caps: Capacities, eos_ids):
    """The real engine over a fresh tiered cache; the worker thread owns both."""
    from pbkv.cache import RadixTree, TieredCache
    from pbkv.engine.hf import EngineOptions, HFEngine

    from pbkv.policy.lru import LRUPolicy

    cache = TieredCache(RadixTree(cfg.cache.block_size), caps, policy)
    engine = HFEngine(lm, cache, policy, disk_dir=cfg.cache.disk_dir, shared_dir=cfg.cache.shared_dir,
                      shared_bytes=cfg.cache.shared_bytes,
                      options=EngineOptions(max_running=cfg.max_running, eos_token_ids=frozenset(eos_ids)))
    engine.fallback = LRUPolicy   # a policy bug must not fail the calls in flight (EngineBase.fallback)
    return engine


def run(cfg: ServeConfig, log_level: str = "info", state: ServerState | None = None) -> ServerState:
    """Serve until stopped; the state after shutdown (`state.setup.save_error`: a failed save)."""
    import uvicorn
    log_to_stderr(log_level)
    state = state if state is not None else build_state(cfg)
    app = create_app(state)
    freeze_startup_heap()
    with stop_signals_return():   # the steps a forced quit left run under it too: a Ctrl-C cuts no save
        run_server(uvicorn.Server(uvicorn_config(app, cfg, host=cfg.host, port=cfg.port, log_level=log_level)), state)
    return state


def freeze_startup_heap() -> None:
    """Leave what start-up built (model, torch, transformers: ~370,000 objects, alive until exit
    anyway) out of the garbage collector's full passes. Each pass over them took ~0.27 s holding
    the GIL, so the event loop and the engine thread stopped; a body of many small JSON values (1
    MB of one-letter messages) set off one or two, even parsed on a worker thread. Collected
    first, so no garbage is kept. For the process's one foreground server (`run`), not for
    `ServerThread`: a test process starts and drops many servers, whose cycles would be kept."""
    gc.collect()
    gc.freeze()


def run_server(server, state: ServerState, sockets: list[socket.socket] | None = None) -> None:
    """Run `server` (a uvicorn.Server of `create_app(state)`) until it stops, then the shutdown
    steps its lifespan did not run. uvicorn's force quit (a second Ctrl-C while it waits for
    connections to close) cuts the answers in flight and skips the lifespan's shutdown; the engine
    thread must still stop (its runs end, the policy and --record hear them; a daemon thread left
    inside torch at exit can abort the process), the predictor be saved and the engine closed."""
    server.run(sockets=sockets)
    if state.on_shutdown:
        log.warning("the server stopped without its shutdown steps (a forced quit, or a stop during "
                    "start-up): running them now (engine thread, predictor save, engine)")
        state.shut_down()


@contextmanager
def stop_signals_return():
    """Let a server stopped by SIGINT or SIGTERM return to its caller. uvicorn shuts down
    gracefully on either, then raises it again under the handler it found, to end the process as
    the signal would have; `pbkv serve` has work left after that (exit 1 after a failed predictor
    save, the replicas' shutdown and hand-off with --replicas), which the re-raise skipped
    (SIGTERM killed the process, or Ray's handler exited). Handlers that do nothing are what
    uvicorn finds; the real ones are back once it returns, so a Ctrl-C during the remaining
    shutdown (the replicas' with --replicas) still stops the process. uvicorn's own force quit (a
    second Ctrl-C while it waits for connections) does not skip the app's shutdown steps
    (`run_server`). Only on the main thread (where signals are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def log_to_stderr(level: str) -> None:
    """Show pbkv's own messages (retrains, saves, fallbacks) at the server's log level, in
    uvicorn's format. Without a handler Python prints only warnings, unprefixed; a handler
    already set (by an embedding program) is left alone."""
    from uvicorn.config import LOG_LEVELS
    from uvicorn.logging import DefaultFormatter
    logger = logging.getLogger("pbkv")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(LOG_LEVELS.get(level, logging.INFO))
    logger.propagate = False   # as uvicorn's loggers: a root handler must not print each line twice


class ServerThread:
    """The real server (uvicorn + the app) on a background thread; `url` once `start` returned.

    Use as a context manager; `stop()` runs the app's shutdown (engine thread stopped, workflows
    ended, predictor saved)."""

    def __init__(self, cfg: ServeConfig, log_level: str = "warning", state: ServerState | None = None):
        import uvicorn
        self.cfg = cfg
        self.state = state if state is not None else build_state(cfg)   # given: an ingress (pbkv.scale)
        self.app = create_app(self.state)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{cfg.host}:{self.port}"
        config = uvicorn_config(self.app, cfg, log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=run_server, args=(self.server, self.state, [self.sock]),
                                        name="pbkv-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)  # waiting for another thread's startup, not for time to pass
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(180)  # shutdown saves the predictor after a last retrain: slow on a busy machine
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
