"""What both engines share: the simulator (`simulator.py`) and the real engine (`hf/engine.py`).

Both serve `Request`s over the same `TieredCache` and `Policy` objects and are driven the same
way (`pbkv.driver.Replay`): the driver schedules callbacks (`at`), starts and ends workflows and
submits requests; the engine tells the policy about each event. This module holds that common
part, so the two engines differ only in how they admit, compute and move KV:
- `EventQueue`: callbacks scheduled at a time, fired in (time, scheduling order);
- `EngineStats`: the counters every bench record reads (each engine adds its own);
- `EngineBase`: the driver API (`at`, `start_workflow`, `end_workflow`, `submit`), the policy
  hooks timed into `stats.policy_seconds`, `CallEvent`s, the FCFS waiting list, unpinning queued
  prefixes when nothing can run, and the "stuck" message;
- `replace_policy`: a policy whose hook raised replaced by a fallback (`EngineBase.fallback`;
  the vLLM connector's shadow uses it too);
- `tokens_by_tier`: how many tokens a list of nodes holds in each tier. Per-tier hit counts
  (`Request.hits`, the real engine's `loaded_tokens`) add a fourth tier after the three local
  ones, "shared" (`HIT_TIERS`, index `SHARED`): a directory several engines read and write
  (`shared_kv.py`), consulted after the local tiers' longest prefix; it is not a `Tier` of the
  cache (no node lives there; local cache management does not see it).
A subclass provides `now` (the engine's time: simulated, or its clock's) and its scheduling loop.

Parts with their own state are composed (`EventQueue`, the stats record); the rest is a small
base class because every piece of it reads the same few fields (cache, tree, policy, waiting
list, stats). The real engine's `CacheOps` (hf/admit.py) and `ExecOps` (hf/execute.py) stay
mixins for the same reason: each reads and writes a dozen fields of one engine, so splitting
them into objects would only route every access through a back-reference.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Callable

from pbkv.cache import Move, Node, Tier, TieredCache
from pbkv.engine.request import HIT_TIERS, SHARED, Request  # noqa: F401  (re-exported)
from pbkv.policy import CallEvent, Policy, PolicyContext

log = logging.getLogger(__name__)


def tokens_by_tier(nodes: list[Node]) -> list[int]:
    """Tokens held by `nodes`, indexed by tier (device, host, disk)."""
    out = [0, 0, 0]
    for n in nodes:
        out[n.tier] += n.tokens
    return out


def replace_policy(cache: TieredCache, failed: Policy, fallback: Callable[[PolicyContext], Policy],
                   clock: Callable[[], float], hook: str) -> Policy:
    """A fresh `fallback(ctx)` in place of `failed`, whose `hook` just raised: the error is logged
    with its traceback (call this from the `except` block), and the new policy is bound to `cache`
    and ranks all of it (every node re-keyed). The caller keeps the returned policy and counts it;
    `EngineBase.fallback` and the vLLM connector's `Shadow` share this."""
    policy = fallback(PolicyContext(block_size=cache.tree.block_size))
    log.exception("the %s policy failed in %s; ranking by %s from now on", failed.name, hook, policy.name)
    policy.bind(cache, clock)
    cache.replace_rules(policy)
    return policy


class EventQueue:
    """Callbacks scheduled at a time. Invariant: due callbacks fire in order of time, then of
    scheduling (ties never compare the callbacks); `scheduled` counts every `push` so far."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self.scheduled = 0

    def push(self, when: float, fn: Callable[[], None]) -> None:
        self.scheduled += 1
        heapq.heappush(self._heap, (when, self.scheduled, fn))

    def next_time(self) -> float:
        """When the earliest callback is due (the queue must not be empty)."""
        return self._heap[0][0]

    def fire_due(self, now: Callable[[], float]) -> None:
        """Run every callback due at `now()`, read again after each (a callback may schedule
        another, and a wall clock moves while callbacks run)."""
        while self._heap and self._heap[0][0] <= now():
            heapq.heappop(self._heap)[2]()

    def __bool__(self) -> bool:
        return bool(self._heap)


@dataclass
class EngineStats:
    """Counters both engines keep; the bench record reads these (each engine's stats add more)."""

    prefills: int = 0                 # prefill passes: a batch (simulator) or one request (real engine)
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefetched_tokens: int = 0        # tokens the policy's prefetches moved up (host/disk -> device)
    policy_calls: int = 0             # policy hooks called (call and workflow events, prefetch offers)
    policy_seconds: float = 0.0       # wall time spent in those hooks (predictions included)
    policy_fallbacks: int = 0         # policies replaced by `EngineBase.fallback` after a hook raised


class EngineBase:
    """The driver API and policy plumbing shared by both engines (see the module docstring).

    Invariants: every policy hook runs through `_timed`; `_waiting` holds the submitted requests
    not yet admitted, in FCFS order; a request is told to the policy (`on_call_start`) once, when
    it is submitted.

    `fallback` (None: a hook's exception propagates, as a simulation or a test wants): a policy
    factory (a server sets LRU). A hook that raises is logged, the policy is replaced for the
    rest of the engine's life by a fresh `fallback(ctx)`, every node is re-ranked by it, and the hook
    runs again on it: a bug in the predictions costs the cache's ranking, not the calls in flight."""

    fallback: Callable[[PolicyContext], Policy] | None = None

    def __init__(self, cache: TieredCache, policy: Policy, stats: EngineStats, clock: Callable[[], float]):
        self.cache, self.tree, self.policy = cache, cache.tree, policy
        self._stats = stats
        self._clock = clock
        self._events = EventQueue()
        self._waiting: list[Request] = []
        # the last admission pass stopped at a request that could not get device space: with
        # nothing running no event can free any, so the queue's pins are released at once
        self._blocked = False
        policy.bind(cache, clock)

    now: float   # the engine's current time (an attribute or a property of the subclass)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ driver API

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run `fn` once the engine's time reaches `when`."""
        self._events.push(when, fn)

    def start_workflow(self, workflow: int, workflow_id: str) -> None:
        self._timed(self.policy.on_workflow_start, workflow, workflow_id)

    def end_workflow(self, workflow: int) -> None:
        nodes = self.cache.end_workflow(workflow)
        self._timed(self.policy.on_workflow_end, workflow, nodes)

    def submit(self, req: Request) -> None:
        """Queue `req` (FCFS) and tell the policy the call started. Its arrival stays as the
        driver stamped it (never later than now); unstamped, it arrives now."""
        req.arrival = self.now if req.arrival is None else min(req.arrival, self.now)
        node, _ = self.tree.match(req.call.hash_ids)
        # the policy learns tool waits and call gaps from this time: the call's issue time, not
        # the end of the prefill pass during which the simulator got to its arrival
        self._timed(self.policy.on_call_start, self._event(req, node, req.arrival))
        self._waiting.append(req)

    # ------------------------------------------------------------------ helpers

    def _fire_events(self) -> None:
        self._events.fire_due(lambda: self.now)

    def _timed(self, hook, *args):
        """Call a policy hook, counting it and its wall time in the stats (a hook that raises:
        see `fallback`)."""
        start = time.perf_counter()
        try:
            out = hook(*args)
        except Exception:
            if self.fallback is None or getattr(hook, "__self__", None) is not self.policy:
                raise
            self._fall_back(hook.__name__)
            out = getattr(self.policy, hook.__name__)(*args)
        self._stats.policy_calls += 1
        self._stats.policy_seconds += time.perf_counter() - start
        return out

    def _fall_back(self, hook: str) -> None:
        self.policy = replace_policy(self.cache, self.policy, self.fallback, self._clock, hook)
        self._stats.policy_fallbacks += 1

    def _event(self, req: Request, node: Node | None, when: float | None = None) -> CallEvent:
        """The policy's view of `req` at `when` (default: now); `hidden` is the model's hidden
        state once a real engine has prefilled it (`req.result.hidden`), else None."""
        call = req.call
        return CallEvent(req.workflow, call.agent, call.step, call, node or self.tree.root,
                         self.now if when is None else when,
                         hidden=getattr(req.result, "hidden", None))

    def _limit(self, req: Request) -> int:
        """Output tokens `req` may produce (admission reserves device space for them)."""
        return req.call.output_length

    def _hold_load(self, req: Request, move: Move, per_tier: list[int]) -> None:
        """`req` waits for `move`, the load of its prefix's host/disk part (`per_tier`: the prompt
        tokens it reuses, by tier). Its pin becomes the move's (which also covers the path of a
        load it held before), and the loaded tokens add to `req.loaded`."""
        if req.node is not None:
            self.tree.unlock(req.node)
        req.move, req.loading, req.node = move, True, move.nodes[-1]
        host, disk = req.loaded
        req.loaded = (host + per_tier[Tier.HOST], disk + per_tier[Tier.DISK])

    def _unpin_waiting(self) -> bool:
        """Nothing runs and the queue head cannot fit: release the prefixes that queued requests
        loaded and still pin (they are matched again when admitted). Whether anything was freed.
        A released prefix may be evicted before its request is admitted: its loads no longer
        count as hits (what is still on the device then is a device hit, the rest recomputed)."""
        freed = False
        for req in self._waiting[1:]:
            if req.node is not None and not req.loading:
                self.tree.unlock(req.node)
                req.node, req.loaded, freed = None, (0, 0), True
        self._blocked = self._blocked and not freed
        return freed

    def _stuck_message(self, req: Request) -> str:
        """Why the queue head `req` can never be admitted (each engine raises its own error)."""
        call = req.call
        return (f"stuck: call {call.workflow_id} step {call.step} needs {call.input_length + self._limit(req)} "
                f"device tokens; capacity {self.cache.capacity.device}, "
                f"evictable {self.cache.evictable(Tier.DEVICE)}")
