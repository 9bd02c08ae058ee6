"""Discrete-event serving engine: continuous batching over the shared cache, time from a cost model.

Each iteration is either a prefill pass (new requests, FCFS, up to `max_prefill_tokens` new
tokens; prefill has priority, as in SGLang; its effects, blocks in the tree and first tokens, come
in the next iteration) or a run of decode steps. A decode run lasts until
the first running request finishes or the next external event (an arrival, a finished load),
so the loop costs O(events), not O(tokens): the batch is constant in between and its step time
is taken at the run's start.

Cache use per request (the same `TieredCache` and `Policy` objects a real engine would use):
- when the scheduler first serves a request, its prompt is matched; a prefix in host/disk is
  loaded back over the host link (a two-phase move; the request waits, others run: KVFlow's
  status-aware scheduling); hits are counted per tier when it is admitted (a loaded prefix
  counts from its tier only while the request still pins it: `EngineBase._unpin_waiting`);
- admission reserves device space for the new prompt tokens and the outputs (evicting in the
  policy's order), and pins the matched path; after prefill the new blocks enter the tree;
- while only decode runs, the policy may prefetch host nodes within the link's budget.
Device->host copies of evicted nodes overlap with compute (full-duplex link): counted, not timed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from pbkv.cache import Node, Tier, TieredCache
from pbkv.engine import base
from pbkv.engine.base import EngineBase, tokens_by_tier
from pbkv.engine.cost import CostModel
from pbkv.engine.prefetch import prepare_prefetches
from pbkv.engine.request import Request
from pbkv.policy import Policy, PrefetchRequest

ADMITTED, LOADING, BLOCKED = "admitted", "loading", "blocked"


class SimulationError(RuntimeError):
    pass


@dataclass
class EngineStats(base.EngineStats):
    loads: int = 0
    load_seconds: float = 0.0


class Simulator(EngineBase):
    """The simulated engine. Drivers call `start_workflow`, `submit`, `end_workflow`, `at`, `run`;
    a cluster hands routed calls over with `arrive`."""

    def __init__(self, cost: CostModel, cache: TieredCache, policy: Policy):
        self.now = 0.0
        super().__init__(cache, policy, EngineStats(), self.clock)
        self.cost = cost
        self.block_size = cache.tree.block_size
        self._running: list[tuple[int, int, Request]] = []  # heap by finish step, then join order
        self._joined = 0
        self._step = 0
        self._sum_input = 0   # prompt tokens of running requests
        self._sum_join = 0    # decode step at which each running request joined
        self._link_free_at = 0.0
        # a decode run ends at the first step reaching `horizon` (`pbkv.scale.cluster` sets it:
        # the earliest moment another instance may send a call here)
        self.horizon = math.inf
        # the requests of the prefill pass that ends at `now`: its effects (blocks in the tree, first
        # tokens, calls of one output token ending) come in the next step, so that behind a router
        # calls issued during the pass see this instance as it is then (`pbkv.scale.cluster`)
        self._pass: list[Request] = []
        self._inflight: dict[int, float] = {}  # node id -> when the load moving it up completes
        # calls a router handed over (`arrive`), not yet submitted: a heap by (time, arrival order)
        self._arrivals: list[tuple[float, int, Request]] = []
        self._arrived = 0
        prof = cost.profile
        self.max_prefill_tokens = prof.max_prefill_tokens
        self.max_running = prof.max_running

    # ------------------------------------------------------------------ driver API

    def clock(self) -> float:
        return self.now

    def run(self) -> None:
        """Serve until no request, event or load is left."""
        while self.step():
            pass

    def step(self) -> bool:
        """One turn of the serving loop (due events, then a prefill pass, a decode run, or a jump
        to the next event); False when nothing is left. `pbkv.scale.cluster` interleaves the
        steps of several instances on one clock."""
        if self._pass:   # the pass ended at `now`: its effects, alone in this step (see `_pass`)
            self._end_pass()
            return True
        self._fire_events()
        if self._waiting and self._prefill_round():
            return True
        if self._running:
            self._decode_round()
        elif self._blocked and self._unpin_waiting():
            return True   # nothing runs, so no event can free memory: waiting for one only delays the head
        elif self._events:
            self.now = max(self.now, self._events.next_time())
        elif self._waiting and self._unpin_waiting():
            return True
        elif self._waiting:
            raise SimulationError(self._stuck_message(self._waiting[0]))
        else:
            return False
        return True

    def arrive(self, req: Request, when: float) -> None:
        """Take `req`, sent here at `when` by a router (`pbkv.scale.cluster`; an idle engine is
        brought to `when`). It is submitted as a plain run's driver event due at `when` would be:
        at this engine's next step, among its own due events in order of time (after the effects
        of a pass ending at `now`), so the policy hears `on_call_start` at the same point and
        sees the same tree. Until then it counts as a waiting request (`load`, `queued`,
        `quiet_until`); it is kept apart from the events, which `quiet_until` reads."""
        self.now = max(self.now, when)
        self._arrived += 1
        heapq.heappush(self._arrivals, (when, self._arrived, req))

    def busy(self) -> bool:
        """Whether `step` has anything to do (requests, runs or scheduled events)."""
        return bool(self._pass or self._waiting or self._running or self._events or self._arrivals)

    def load(self) -> int:
        """Requests waiting, in the prefill pass or running (a router's view of this instance's queue)."""
        return self.queued() + len(self._pass) + len(self._running)

    def queued(self) -> int:
        """Requests waiting for admission (those `arrive` handed over included)."""
        return len(self._waiting) + len(self._arrivals)

    def quiet_until(self) -> float:
        """A lower bound on when this engine next ends a call (the driver's cue to issue more)
        if nothing is submitted meanwhile: its next event, now if its queue may prefill (an
        output of one token ends with the pass), else the running head's end at today's step
        time (batch and context only grow before that end, and a step never gets faster)."""
        t = self._events.next_time() if self._events else math.inf
        if self._pass or ((self._waiting or self._arrivals) and not self._blocked):
            return min(t, self.now)
        if self._running:
            t = min(t, self.now + (self._running[0][0] - self._step) * self._step_seconds())
        return t

    def _fire_events(self) -> None:
        """The due events and the calls handed over by `arrive` (all due), in order of time; at
        one time the engine's own events first (they were scheduled before the call arrived)."""
        while self._arrivals:
            when, _, req = heapq.heappop(self._arrivals)
            self._events.fire_due(lambda when=when: min(when, self.now))
            self.submit(req)
        super()._fire_events()

    # ------------------------------------------------------------------ scheduling

    def _prefill_round(self) -> bool:
        """One prefill pass over the queue (FCFS); whether anything was prefilled. Sets
        `_blocked`: nothing was, and a request that is not loading could not be admitted."""
        batch: list[Request] = []
        flops, budget = 0.0, self.max_prefill_tokens
        blocked = False
        for req in self._waiting:
            if req.loading:
                continue
            if len(self._running) + len(batch) >= self.max_running:
                break
            status = self._admit(req)
            if status == BLOCKED:
                blocked = True
                break
            if status == LOADING:
                continue
            new = req.call.input_length - req.cached
            batch.append(req)
            flops += self.cost.prefill_flops(new, req.cached)
            budget -= new
            if budget <= 0:
                break
        self._blocked = blocked and not batch
        if not batch:
            return False
        admitted = set(map(id, batch))
        self._waiting = [r for r in self._waiting if id(r) not in admitted]
        seconds = self.cost.prefill_seconds(flops)
        self.now += seconds
        self.stats.prefills += 1
        self.stats.prefill_seconds += seconds
        self._pass = batch
        return True

    def _end_pass(self) -> None:
        batch, self._pass = self._pass, []
        for req in batch:
            self._after_prefill(req)

    def _admit(self, req: Request) -> str:
        """Match, then load the prefix from below or pin it and reserve space for the rest."""
        call = req.call
        node, matched = self.tree.match(call.hash_ids)
        busy = [self._inflight[n.id] for n in node.path() if n.id in self._inflight] if matched else []
        if busy:  # another load is moving part of this prefix up: wait for it (never split or load it twice)
            req.loading = True
            self.at(max(busy), lambda: setattr(req, "loading", False))
            return LOADING
        if matched and node.end > matched:  # pin and load only what matches
            node = self.tree.split(node, matched - node.start)
        path = node.path() if matched else []
        per_tier = tokens_by_tier(path)
        held = sum(per_tier)
        over = held - (call.input_length - 1)  # the last prompt token is always computed
        if over > 0:
            per_tier[path[-1].tier] -= over
        lower = [n for n in path if n.tier != Tier.DEVICE]
        if lower:
            move = self.cache.prepare_load(lower, keep_lock=True)
            if move is None:
                return BLOCKED
            self._hold_load(req, move, per_tier)
            done_at = self._start_load(lower)
            self.at(done_at, lambda: self._load_done(req))
            return LOADING
        pin = path[-1] if path else None
        if pin is not None:
            self.tree.lock(pin)
        cached = per_tier[Tier.DEVICE]
        # new space: the prompt tokens the pinned path does not hold, and the outputs (a prompt
        # held whole recomputes its last token into the pinned block: no space of its own)
        need = call.input_length - held + call.output_length
        if not self.cache.reserve(need):
            if pin is not None:
                self.tree.unlock(pin)
            return BLOCKED
        req.count_hits(cached)
        if req.node is not None:  # the pin its load held
            self.tree.unlock(req.node)
        req.node, req.reserved, req.cached, req.admitted = pin, need, cached, self.now
        if pin is not None:
            self.tree.touch(pin, self.now, req.workflow, call.agent)
        return ADMITTED

    def _start_load(self, nodes: list[Node]) -> float:
        done_at = self._transfer(tokens_by_tier(nodes))
        for n in nodes:
            self._inflight[n.id] = done_at
        return done_at

    def _complete(self, move) -> None:
        self.cache.complete(move)
        for n in move.nodes:
            self._inflight.pop(n.id, None)

    def _load_done(self, req: Request) -> None:
        self._complete(req.move)
        req.move, req.loading = None, False

    def _after_prefill(self, req: Request) -> None:
        call = req.call
        tail = call.input_length - self.block_size * (len(call.hash_ids) - 1)
        node, added = self.cache.insert(call.hash_ids, tail, self.now)
        req.reserved -= added
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = node
        self.tree.touch(node, self.now, req.workflow, call.agent)
        req.first_token = self.now
        remaining = call.output_length - 1
        if remaining <= 0:
            self._finish(req)
            return
        req.join_step, req.finish_step = self._step, self._step + remaining
        self._joined += 1
        heapq.heappush(self._running, (req.finish_step, self._joined, req))
        self._sum_input += call.input_length
        self._sum_join += self._step

    def _step_seconds(self) -> float:
        """One decode step of the running batch now."""
        batch = len(self._running)
        return self.cost.decode_step_seconds(batch, self._sum_input + batch * (self._step + 1) - self._sum_join)

    def _decode_round(self) -> None:
        running = self._running
        dt = self._step_seconds()
        steps = running[0][0] - self._step
        until = min(self.horizon, self._events.next_time()) if self._events else self.horizon
        if until < self.now + steps * dt:   # (a far event, e.g. a week-long tool wait: no division)
            # the steps that reach the next event; the tolerance keeps an event due exactly at a
            # step's end (the same float sum) from costing one step more through rounding
            steps = min(steps, max(1, math.ceil((until - self.now) / dt - 1e-9)))
        self._prefetch(steps * dt)
        self.now += steps * dt
        self._step += steps
        self.stats.decode_steps += steps
        self.stats.decode_seconds += steps * dt
        while running and running[0][0] <= self._step:
            _, _, req = heapq.heappop(running)
            self._sum_input -= req.call.input_length
            self._sum_join -= req.join_step
            self._finish(req)

    def _finish(self, req: Request) -> None:
        self._blocked = False   # memory comes free: the queue may move (`quiet_until` relies on it)
        req.finished = self.now
        self.cache.release(req.reserved)
        req.reserved = 0
        self.tree.touch(req.node, self.now, req.workflow, req.call.agent)  # recency = end of use
        self.tree.unlock(req.node)
        self._timed(self.policy.on_call_end, self._event(req, req.node))
        req.on_done(req)

    # ------------------------------------------------------------------ transfers

    def _transfer(self, tokens_by_tier: list[int]) -> float:
        """Queue a load on the host->device link; return when it completes."""
        seconds = self.cost.load_seconds(tokens_by_tier)
        start = max(self.now, self._link_free_at)
        self._link_free_at = start + seconds
        self.stats.loads += 1
        self.stats.load_seconds += seconds
        return self._link_free_at

    def _prefetch(self, seconds: float) -> None:
        """A decode-only run: offer the policy the link's idle capacity for host->device loads."""
        budget = int(self.cost.tokens_per_second_pcie() * seconds)
        if budget <= 0 or self._link_free_at > self.now:
            return
        wanted = self._timed(self.policy.prefetch, PrefetchRequest(budget, self.cache.free(Tier.DEVICE), self.now))
        for move, tokens in prepare_prefetches(self.cache, wanted, budget, self.policy.allow_evict_for_prefetch,
                                               lambda n: n.id in self._inflight,
                                               lambda n: self._timed(self.policy.prefetch_floor, n)):
            self.stats.prefetched_tokens += tokens
            done_at = self._start_load(move.nodes)
            self.at(done_at, lambda m=move: self._complete(m))
