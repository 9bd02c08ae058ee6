"""N simulated engine instances behind a router, on one clock: the multi-instance simulator.

`Cluster` is an engine for `pbkv.driver.Replay` (same `now`/`at`/`start_workflow`/`submit`/
`end_workflow`/`run`). Each instance is a `Simulator` with its own `TieredCache` and policy
object; a `pbkv.route` router places every call, seeing each instance through `SimView`.
Routers may be out-of-tree, so every decision is checked (`pbkv.route.base.check_decision`)
before the cluster acts on it: a bad one raises `BadDecision`, a ValueError naming the router,
the field and the value.

Time: the cluster keeps the driver's events; instances keep their own. `run` always advances
whichever is earliest: a due driver event, or one `step` of the instance whose clock is
behind. Before an instance steps, its `horizon` is set to the earliest moment a call may be
sent to it: the next driver event, or the moment another instance may end a call (its
`quiet_until`; the driver then issues the workflow's next call, which may land here). A decode
run stops there, so a call routed to an instance in the middle of a long decode run joins at
the next step, as in continuous batching, and the router sees the instance as it is then. A
prefill pass cannot stop; its effects (blocks in the tree, calls ending, their write-behind to
the shared tier) come in the instance's next step, after the driver events due during the pass,
so a call issued then never sees or reads KV that does not exist yet. An
instance that was idle is brought to the cluster's time when a call is routed to it.
The router decides at the call's time; the instance takes the call (`Simulator.arrive`), and
with one instance a workflow's start, where a plain run's engine would, in its own event order
(after such a pass's effects), so its policy hears the same hooks in the same order with the same
arguments: one instance behind any router reproduces the plain record exactly, prefetches too.

KV movement: when the router says `fetch_from`, the prompt's leading full blocks the source
holds beyond what the target holds are sent over the target's inbound `Link` (transfers to one
instance queue behind each other; reads from the shared tier queue on that one device instead,
whichever instance reads), inserted into the target's device tier when they arrive,
and only then is the call submitted there. Bytes sent are counted in `stats.bytes_moved`.
With a `SharedTier`, every finished call's prompt blocks are also written behind to it, and a
call whose prefix the shared tier holds further than the target or the router's peer fetch
reads the extra blocks from it when that beats recomputing them (`stats.bytes_from_shared`). If the target cannot make room
for them (or part of the prefix sits in its host/disk tier, below which device blocks cannot
hang), the call is submitted anyway and recomputes (the bytes still count: they were sent).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from pbkv.cache import Tier
from pbkv.engine.base import EventQueue
from pbkv.engine.request import Request
from pbkv.engine.simulator import Simulator
from pbkv.route import RouteRequest, Router
from pbkv.route.base import check_decision
from pbkv.scale.links import Link


class SharedTier:
    """The simulated shared KV tier: full blocks any instance wrote, LRU-bounded in tokens; reads
    cross `link` (its bandwidth and latency) into the reading instance. It is one device: reads
    by all instances queue behind each other (`free_at`), not behind an instance's peer fetches."""

    def __init__(self, capacity_tokens: int, link: Link, block_size: int):
        self.capacity_blocks = capacity_tokens // block_size
        self.link = link
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.free_at = 0.0   # when the reads queued so far are done

    def prefix_blocks(self, hash_ids) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def write(self, hash_ids) -> int:
        """Store blocks (chained ids); returns how many were new."""
        new = 0
        for h in hash_ids:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                new += 1
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
        return new


class SimView:
    """A `pbkv.route.ReplicaView` of one simulated instance."""

    def __init__(self, index: int, engine: Simulator, workflow_index: dict[str, int]):
        self.id = str(index)
        self.engine = engine
        self._wf = workflow_index

    @property
    def load(self) -> float:
        return self.engine.load()

    @property
    def queued(self) -> float:
        return self.engine.queued()

    def cached_prefix_tokens(self, hash_ids) -> int:
        _, matched = self.engine.tree.match(list(hash_ids))
        return matched * self.engine.block_size

    def workflow_tokens(self, workflow_id: str) -> int:
        nodes = self.engine.tree.workflow_nodes.get(self._wf.get(workflow_id, -1), {})
        return sum(n.tokens for n in nodes.values() if n.alive)

    @property
    def workflow_count(self) -> int:
        return len(self.engine.tree.workflow_nodes)


@dataclass
class ClusterStats:
    bytes_moved: float = 0.0
    fetches: int = 0
    fetched_tokens: int = 0
    fetch_failed: int = 0        # fetches from a peer whose blocks found no room on the target
    shared_reads: int = 0
    shared_read_failed: int = 0  # the same for reads from the shared tier
    bytes_from_shared: float = 0.0
    bytes_to_shared: float = 0.0
    calls: list[int] = field(default_factory=list)   # calls routed to each instance
    moves: int = 0                                    # calls placed off their workflow's previous instance


class Cluster:
    def __init__(self, instances: list[Simulator], router: Router, link: Link, kv_bytes_per_token: float,
                 gpus_per_instance: int = 1, shared: SharedTier | None = None):
        if not instances:
            raise ValueError("a cluster needs at least one instance")
        self.instances, self.router, self.link = instances, router, link
        self.kv_bytes_per_token, self.gpus = kv_bytes_per_token, gpus_per_instance
        self.shared = shared
        self.stats = ClusterStats(calls=[0] * len(instances))
        self._events = EventQueue()
        self._t = 0.0
        self._current: Simulator | None = None
        self._wf_index: dict[str, int] = {}
        self._wf_id: dict[int, str] = {}
        self._started: dict[int, set[int]] = {}     # workflow -> instances told it started
        self._last: dict[int, int] = {}              # workflow -> instance of its latest call
        self._inbound_free = [0.0] * len(instances)
        self.views = [SimView(k, e, self._wf_index) for k, e in enumerate(instances)]

    # ------------------------------------------------------------------ driver API

    @property
    def now(self) -> float:
        return self._current.now if self._current is not None else self._t

    def at(self, when: float, fn) -> None:
        self._events.push(when, fn)   # a time already past fires next, in order of time

    def start_workflow(self, workflow: int, workflow_id: str) -> None:
        self._wf_index[workflow_id] = workflow
        self._wf_id[workflow] = workflow_id
        self._started[workflow] = set()
        if len(self.instances) == 1:   # every call of it will run there: tell it when a plain run does
            self._started[workflow].add(0)
            self._tell(self.instances[0], lambda: self.instances[0].start_workflow(workflow, workflow_id))

    def end_workflow(self, workflow: int) -> None:
        for k in sorted(self._started.pop(workflow, ())):
            self.instances[k].end_workflow(workflow)
        self._last.pop(workflow, None)
        self.router.on_workflow_end(self._wf_id.pop(workflow, ""))

    def submit(self, req: Request) -> None:
        if req.arrival is None:   # a KV transfer's wait before the call reaches its engine counts
            req.arrival = self.now
        call = req.call
        request = RouteRequest(workflow_id=self._wf_id.get(req.workflow, call.workflow_id), agent=call.agent,
                               hash_ids=tuple(call.hash_ids), input_tokens=call.input_length,
                               output_tokens=call.output_length,
                               reuse_probability=self._reuse_probability(req.workflow))
        decision = self.router.choose(request, self.views)
        # routers may be out-of-tree (`package.module:Class`): act only on a well-formed decision
        check_decision(self.router, decision, request, self.views)
        k = int(decision.replica)   # view ids are str(instance index)
        engine = self.instances[k]
        engine.now = max(engine.now, self.now)
        self.stats.calls[k] += 1
        if self._last.get(req.workflow, k) != k:
            self.stats.moves += 1
        self._last[req.workflow] = k
        if k not in self._started.setdefault(req.workflow, set()):
            self._started[req.workflow].add(k)
            engine.start_workflow(req.workflow, request.workflow_id)
        _, local = engine.tree.match(call.hash_ids)
        peer = self._peer_blocks(call, decision, local)
        shared = self._shared_blocks(call, local, peer)
        if shared > peer:
            self._fetch(k, list(call.hash_ids[:shared]), req, local, self.shared.link, shared=True)
        elif peer > local:
            self._fetch(k, list(call.hash_ids[:peer]), req, local, self.link)
        else:
            engine.arrive(req, self.now)
        if self.shared is not None:
            self._write_behind(req)

    def _tell(self, engine: Simulator, fn) -> None:
        """Run `fn` (a driver call on `engine`) where a plain run's engine would: at once inside
        that engine's step, else as its event due now, in its own event order (after a pass
        ending at its `now`, after its events due earlier)."""
        if self._current is engine:
            fn()
        else:
            engine.at(self.now, fn)

    def _reuse_probability(self, workflow: int) -> float | None:
        """The prediction of the instance that ran the workflow's latest call (its policy saw
        every call so far there; None when it predicts nothing, e.g. LRU)."""
        k = self._last.get(workflow)
        return None if k is None else self.instances[k].policy.reuse_probability(workflow)

    def run(self) -> None:
        """Serve until no instance has work and no driver event is left."""
        while True:
            tg = self._events.next_time() if self._events else math.inf
            busy = [(e.now, k) for k, e in enumerate(self.instances) if e.busy()]
            if not busy and tg == math.inf:
                return
            ti, k = min(busy) if busy else (math.inf, -1)
            if tg <= ti:
                self._t = max(self._t, tg)
                self._events.fire_due(lambda: self._t)
                continue
            engine = self.instances[k]
            engine.horizon = min([tg] + [self.instances[j].quiet_until() for _, j in busy if j != k])
            self._current = engine
            try:
                engine.step()
            finally:
                self._current = None
            self._t = max(self._t, min(ti, tg))

    # ------------------------------------------------------------------ KV movement

    def _fetch(self, k: int, blocks: list[int], req: Request, local: int, link: Link, shared: bool = False) -> None:
        """Send `blocks` (a prompt's leading full blocks; the target holds the first `local`)."""
        engine = self.instances[k]
        tokens = (len(blocks) - local) * engine.block_size
        nbytes = tokens * self.kv_bytes_per_token
        if shared:   # one device for every instance's reads
            done = self.shared.free_at = max(self.now, self.shared.free_at) + link.seconds(nbytes, self.gpus)
            self.stats.shared_reads += 1
            self.stats.bytes_from_shared += nbytes
        else:        # the target's inbound link
            done = self._inbound_free[k] = max(self.now, self._inbound_free[k]) + link.seconds(nbytes, self.gpus)
            self.stats.fetches += 1
            self.stats.fetched_tokens += tokens
            self.stats.bytes_moved += nbytes
        self.at(done, lambda: self._arrived(k, blocks, req, shared))

    def _peer_blocks(self, call, decision, local: int) -> int:
        """Leading blocks the target holds once the router's peer fetch lands: `local` plus the
        fetched tokens' whole blocks, never more than the source holds (a router cannot conjure
        KV; built-in routers never ask for more) and never fewer than `local`."""
        if decision.fetch_from is None:
            return local
        _, held = self.instances[int(decision.fetch_from)].tree.match(call.hash_ids)
        wanted = local + decision.fetch_tokens // self.instances[0].block_size
        return max(local, min(wanted, held))

    def _shared_blocks(self, call, local: int, peer: int) -> int:
        """Leading full blocks to read from the shared tier: its prefix when longer than what the
        target or a peer transfer gives and reading it beats recomputing it; else 0."""
        if self.shared is None:
            return 0
        full = call.input_length // self.instances[0].block_size
        have = self.shared.prefix_blocks(call.hash_ids[:full])
        extra = (have - max(local, peer)) * self.instances[0].block_size
        if extra <= 0:
            return 0
        queued = max(0.0, self.shared.free_at - self.now)   # reads by other instances ahead of this one
        read_s = queued + self.shared.link.seconds(extra * self.kv_bytes_per_token, self.gpus)
        return have if read_s < self.router.config.recompute_s(extra) else 0

    def _write_behind(self, req: Request) -> None:
        """When the call ends, its prompt's full blocks go to the shared tier (write-behind: the
        copy overlaps with compute, counted in bytes, not in time)."""
        done = req.on_done

        def on_done(r: Request) -> None:
            full = r.call.input_length // self.instances[0].block_size
            written = self.shared.write(r.call.hash_ids[:full])
            self.stats.bytes_to_shared += written * self.instances[0].block_size * self.kv_bytes_per_token
            done(r)
        req.on_done = on_done

    def _arrived(self, k: int, blocks: list[int], req: Request, shared: bool = False) -> None:
        engine = self.instances[k]
        engine.now = max(engine.now, self._t)
        node, have = engine.tree.match(blocks)
        missing = (len(blocks) - have) * engine.block_size
        cache = engine.cache
        # device blocks may only hang below device nodes: if part of the prefix sits in the
        # target's host or disk tier, the call loads that part itself and recomputes the rest
        if missing > 0 and (have == 0 or node.tier == Tier.DEVICE):
            engine.tree.lock(node)   # making room must not evict the path the blocks extend
            if cache.reserve(missing):
                _, added = cache.insert(blocks, engine.block_size, engine.now)
                cache.release(missing - added)
            else:
                self._failed(shared)
            engine.tree.unlock(node)
        elif missing > 0:
            self._failed(shared)
        engine.arrive(req, self._t)   # keeps the arrival stamped in `submit`: the KV's wait is latency

    def _failed(self, shared: bool) -> None:
        if shared:
            self.stats.shared_read_failed += 1
        else:
            self.stats.fetch_failed += 1
