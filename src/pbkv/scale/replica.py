"""One pbkv engine replica of `pbkv serve --replicas N` (a Ray Serve deployment; needs `pbkv[scale]`).

A replica is today's single-process engine side, built by the same `pbkv.serve.build_state`
from the same `ServeConfig` (model, `CacheConfig` passed through unchanged, policy, workflow
table, engine thread): everything but HTTP. The ingress (`pbkv.scale.serve_app`) parses,
checks and tokenizes a request, then streams `generate(route, job)` from the replica its router
chose: first `{"replica": id}` (so the ingress knows where the call runs before any text), then
text pieces (`str`), then exactly one `Done`, the same events `EngineWorker` gives a local job.
Closing the stream early (the client went away, or Ray cancelled it) cancels the job.

`record_routing_stats` reports the replica's cache for the router: `ReplicaSnapshot.to_stats()`
(every block id it caches in any tier, each live workflow's tokens of KV and, when its policy
predicts one, the probability the workflow calls again (`reuse`), its load = jobs in flight) plus
`tiers` (block ids per tier), `costs` (what it measured: seconds per prefilled token, once its
engine timed a prefill, and per token of KV fetched from another replica, once it fetched; the
router uses them with `measured_costs`, `pbkv.scale.adapter.measured_config`) and a `seq` that
changes with every report; it is taken on the engine thread, between two engine steps, like /metrics.

KV movement: when the router decided that this call's prefix is better fetched from another
replica than recomputed, `route` carries `fetch` (`pbkv.scale.adapter.mark_fetch`). Before
queueing the call the replica, unless its own load rule would recompute those tokens anyway
(its measured rates: the router's costs are estimates), asks that one for the blocks (`export_prefix`, a call through the
deployment's own handle pinned to it) and puts them in its engine's inbox (`pbkv.engine.hf.peer`),
where the call's admission reads them after its local prefix. A fetch that fails or takes longer
than `FETCH_TIMEOUT_S` is given up: the call recomputes those tokens, nothing else changes.

Folders (`replica_config`): every replica reads and writes the same `--shared-dir` (that is the
point of the shared tier: a call routed to replica B loads the prefix A computed), but a
`--disk-dir` is private to one engine (its files are named by a per-process counter), so each
replica gets its own subfolder of it, `replica-<id>`; the engine's store removes its own folder
inside it at shutdown, and the replica then removes `replica-<id>` when it created it and it is
empty (`start_engine`, `stop_engine`). A replica killed before its shutdown cannot: each replica
holds a lock on `replica-<id>.lock` for its life, and each new replica first removes the
subfolders whose lock nobody holds (`pbkv.scale.disk`).

Health (`check_health`, called by Ray's controller every `health_check_period_s`): it raises
while the engine thread is dead or stuck (`pbkv.scale.health.EngineWatch`), so Ray replaces a
replica whose event loop still answers but whose calls never would.

Shutdown (`stop`): the ingress asks every replica to stop before it deletes the deployment, so it
hears each one's failed predictor save (`pbkv serve` then exits 1, as one process does) and gets
the ended workflows of a replica that had too few to train on (`pbkv.scale.handoff`). `stop`
runs `stop_engine` once, off the event loop (health checks still answer: a stopping replica
passes them, its engine thread being stopped on purpose); Ray's graceful stop (`__del__`) then
finds it done. A replica the ingress could not reach stops in `__del__` as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from pbkv.engine.hf.peer import fetch_start
from pbkv.scale import disk
from pbkv.scale.health import EngineWatch
from pbkv.scale.options import ReplicaOptions
from pbkv.route import ReplicaSnapshot
from pbkv.serve.gauges import TIERS, engine_snapshot
from pbkv.serve.jobs import Done, Job
from pbkv.serve.server import ServeConfig, build_state

log = logging.getLogger("pbkv.scale")
FETCH_TIMEOUT_S = 10.0   # a fetch not done by then is given up (the tokens are recomputed)


def replica_config(cfg: ServeConfig, replica_id: str) -> ServeConfig:
    """`cfg` for one replica: the same shared directory, its own subfolder of `disk_dir`."""
    if not cfg.cache.disk_dir:
        return cfg
    own = disk.folder(cfg.cache.disk_dir, replica_id)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, disk_dir=own))


@dataclasses.dataclass
class OwnDisk:
    """The `--disk-dir` subfolder a replica created, and its claim on it (`pbkv.scale.disk`)."""
    parent: str
    replica_id: str
    lock_fd: int

    @property
    def path(self) -> str:
        return disk.folder(self.parent, self.replica_id)


def start_engine(cfg: ServeConfig, replica_id: str):
    """(the replica's `ServerState`, its `OwnDisk` or None). With a `disk_dir`: first the
    subfolders of replicas gone without their shutdown are removed (`disk.sweep`), then, when
    `replica_config`'s subfolder does not exist yet, this replica claims it before the engine
    creates it (only what pbkv created is ever removed: by `stop_engine`, or by a later sweep)."""
    own = replica_config(cfg, replica_id)
    if own is cfg:
        return build_state(own), None
    parent = cfg.cache.disk_dir
    disk.sweep(parent)
    mine = None
    if not os.path.exists(own.cache.disk_dir):
        mine = OwnDisk(parent, replica_id, disk.claim(parent, replica_id))
    try:
        return build_state(own), mine
    except BaseException:
        _remove_own(mine)
        raise


def stop_engine(state, mine: OwnDisk | None) -> None:
    """The single-process shutdown (engine thread stopped, every workflow ended, the predictor
    saved, the engine closed, which removes its disk folder), then the replica's subfolder if it
    is empty, and its claim."""
    for fn in getattr(state, "on_shutdown", ()):
        try:
            fn()
        except Exception:  # noqa: BLE001 - run every shutdown step
            log.exception("replica shutdown step failed")
    _remove_own(mine)


def _remove_own(mine: OwnDisk | None) -> None:
    if mine is None:
        return
    try:
        os.rmdir(mine.path)
    except OSError:   # not empty (files put there by someone else) or never made: left as is
        pass
    disk.release(mine.parent, mine.replica_id, mine.lock_fd)


def cache_stats(engine, table, load: float, replica_id: str, fetch_s_per_token: float | None = None) -> dict:
    """What a replica reports to the router (see the module docstring). Engine thread only."""
    names = {tier: name for name, tier in TIERS}
    tiers: dict[str, list[int]] = {name: [] for name, _ in TIERS}
    for node in engine.tree.iter_nodes():
        tiers[names[node.tier]].extend(node.blocks)
    workflows, reuse = {}, {}
    policy = getattr(engine, "policy", None)
    for run in table.live.values():
        if run.workflow_id is not None:
            nodes = engine.tree.workflow_nodes.get(run.workflow, {})
            workflows[run.workflow_id] = sum(n.tokens for n in nodes.values() if n.alive)
            p = policy.reuse_probability(run.workflow) if policy is not None else None
            if p is not None:
                reuse[run.workflow_id] = float(p)
    blocks = frozenset(b for ids in tiers.values() for b in ids)
    snap = ReplicaSnapshot(replica_id, float(load), blocks, workflows, engine.tree.block_size, reuse)
    costs = {}
    rates = getattr(engine, "rates", None)
    if rates is not None and rates.prefills:
        costs["prefill_s_per_token"] = 1.0 / rates.prefill_tps
    if fetch_s_per_token is not None:
        costs["transfer_s_per_token"] = fetch_s_per_token
    return snap.to_stats() | {"tiers": tiers, "costs": costs}


class EngineReplica:
    """The deployment's class (`serve_app.engine_deployment` wraps it in `serve.deployment`)."""

    def __init__(self, cfg: ServeConfig, engine_stall_s: float = ReplicaOptions.engine_stall_s):
        from ray import serve   # here, so `cache_stats` imports without Ray
        self.id = serve.get_replica_context().replica_id.unique_id
        self.state, self.own_disk = start_engine(cfg, self.id)
        self.watch = EngineWatch(self.state.worker, engine_stall_s)
        self.seq = 0
        self._peers = None   # the deployment's handle, to ask another replica for KV
        self.fetch_s_per_token = None   # measured over this replica's fetches (running mean)

    def check_health(self) -> None:
        """Ray Serve's health check: raises while the engine thread is dead or stuck (`EngineWatch`),
        unless the replica is stopping. Not async on purpose: it never waits, so it answers even
        while the engine is busy."""
        if not getattr(self, "stopping", False):
            self.watch.check()

    async def stop(self) -> dict:
        """The replica's shutdown (see the module docstring), once: {"save_error": why its
        predictor save failed or None, "unsaved": the ended workflows it had too few of to train
        on, left to the ingress (`pbkv.scale.handoff`)}."""
        setup = getattr(self.state, "setup", None)
        if not getattr(self, "stopping", False):
            self.stopping = True
            if setup is not None:
                setup.hand_off = True
            await asyncio.to_thread(stop_engine, self.state, getattr(self, "own_disk", None))
        return {"save_error": getattr(setup, "save_error", None), "unsaved": list(getattr(setup, "unsaved", []))}

    # ------------------------------------------------------------------ the router's view

    async def record_routing_stats(self) -> dict:
        worker = self.state.worker
        stats = await asyncio.wrap_future(worker.call(
            lambda: cache_stats(worker.engine, worker.table, worker.in_flight, self.id, self.fetch_s_per_token)))
        self.seq += 1
        return stats | {"seq": self.seq}

    # ------------------------------------------------------------------ calls

    async def generate(self, route: dict, job: Job):
        """One call: `{"replica": id}`, text pieces, then one `Done` (see the module docstring).
        `route` is the router's hints (unused here: it travels as an argument so the router reads it)."""
        yield {"replica": self.id}
        fetch = route.get("fetch")
        if fetch and fetch.get("from") != self.id:
            await self._fetch(route["hash_ids"], fetch)
        worker = self.state.worker
        worker.submit(job)
        done = None
        try:
            while done is None:
                event = await job.events.get()
                pieces = [event]
                while not isinstance(pieces[-1], Done) and not job.events.empty():  # a burst: one message
                    pieces.append(job.events.get_nowait())
                if isinstance(pieces[-1], Done):
                    done = pieces.pop()
                if pieces:
                    yield "".join(pieces)
            yield done
        finally:
            if done is None:   # the ingress stopped reading: stop generating for nobody
                worker.cancel(job)

    async def _fetch(self, hash_ids: list[int], fetch: dict) -> int:
        """Ask replica `fetch["from"]` for this prompt's blocks up to `first + blocks`, from where
        the prefix this engine holds ends (at most `first`), unless this engine would recompute
        them anyway (`peer.fetch_start`), and put what it sends in the engine's inbox; returns
        the blocks received (0 when none)."""
        end = int(fetch["first"]) + int(fetch["blocks"])
        keys = list(hash_ids[:end])
        worker = self.state.worker
        # from what this engine holds now (admission reads the inbox from where the prefix it
        # holds ends), and only what its load rule would read rather than recompute
        first = await asyncio.wrap_future(
            worker.call(lambda: fetch_start(worker.engine, keys, int(fetch["first"]))))
        if first is None:
            return 0
        want = end - first
        start = time.perf_counter()
        try:
            if self._peers is None:
                from ray import serve
                ctx = serve.get_replica_context()
                self._peers = serve.get_deployment_handle(ctx.deployment, ctx.app_name).options(
                    method_name="export_prefix")
            blocks, kv = await asyncio.wait_for(
                self._peers.remote({"pin": fetch["from"]}, keys, first), FETCH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure only costs a recompute
            log.warning("fetching %d KV blocks from replica %s failed: %r", want, fetch["from"], exc)
            return 0
        if not blocks:
            return 0
        self._saw_fetch(blocks * worker.engine.tree.block_size, time.perf_counter() - start)
        return await asyncio.wrap_future(worker.call(lambda: worker.engine.peer.put(keys[first:first + blocks], kv)))

    def _saw_fetch(self, tokens: int, seconds: float, alpha: float = 0.3) -> None:
        """Seconds per token of a fetch (the request, the source's read, Ray's transfer and
        deserialisation), as a running mean like the engine's own rates."""
        rate = seconds / tokens
        old = self.fetch_s_per_token
        self.fetch_s_per_token = rate if old is None else old + alpha * (rate - old)

    async def export_prefix(self, pin: dict, keys: list[int], first: int):
        """(blocks, CPU KV) of this prompt's blocks `first`.. that this replica caches (`pin` names
        this replica: the router's cue, see `pbkv.scale.adapter.pinned`)."""
        worker = self.state.worker
        return await asyncio.wrap_future(worker.call(lambda: worker.engine.export_prefix(keys, first)))

    async def end_workflow(self, workflow_id: str) -> bool:
        """Ends this replica's run of `workflow_id`; False when it has none."""
        return await asyncio.wrap_future(self.state.worker.end_workflow(workflow_id))

    # ------------------------------------------------------------------ broadcast to every replica

    def info(self) -> dict:
        """What the ingress needs to check and tokenize requests as this replica would."""
        s = self.state
        return {"replica": self.id, "model_name": s.model_name, "policy": s.policy_name,
                "max_context": s.max_context, "block_size": s.worker.engine.tree.block_size,
                "tokenizer": s.tokenizer}

    async def metrics(self) -> tuple[str, str]:
        """(replica id, this replica's /metrics text)."""
        s, worker = self.state, self.state.worker
        snapshot = await asyncio.wrap_future(worker.call(lambda: engine_snapshot(
            worker.engine, worker.in_flight, len(worker.table.live), s.metrics.hit_rates())))
        return self.id, s.metrics.exposition(snapshot).decode()

    def __del__(self):
        """Ray Serve's graceful stop: `stop_engine` (nothing when the constructor failed early, or
        when `stop` ran it)."""
        if hasattr(self, "state") and not getattr(self, "stopping", False):
            self.stopping = True
            stop_engine(self.state, getattr(self, "own_disk", None))
