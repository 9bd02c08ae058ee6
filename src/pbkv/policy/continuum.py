"""Continuum / CacheTTL: pin a paused workflow's KV on the device for a TTL chosen per pause.

Source: Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV
Cache Time-to-Live" (arXiv 2511.02230, renamed CacheTTL in v4; github.com/Hanchenli/vllm-continuum).
When a call ends and its workflow goes into a tool call, Continuum keeps the call's KV on the
GPU for a time-to-live chosen from what eviction would cost (reload or recompute, plus the wait
to be scheduled again) against the memory the pin holds; when the TTL expires the KV is an
ordinary eviction candidate again.

Here:
- pauses (call end -> the workflow's next call) are learned online per agent of the ending
  call (the last `WINDOW` observations: the empirical tool-time distribution F);
- the TTL is tau* + a queueing allowance, tau* maximising
      U(tau) = F(tau) * reload_s  -  hold * E[min(pause, tau)],
  per token of the path: reload_s = seconds to get one token's KV back (a host load when a host
  tier exists, else recompute), hold = the engine-seconds one token of device memory is worth
  per second (1 / device capacity). tau* = 0 with U <= 0 everywhere means "do not pin". The
  allowance is the running mean of call durations (submit -> end): a request waits in the
  queue before it runs, and Continuum's pin lasts until the next request is scheduled;
- a pin is soft: pinned nodes rank after every unpinned node (LRU among themselves), never a
  lock, so the cache can always make room; expiry is applied at the next engine event (call,
  eviction, decode round), then the node falls back to plain LRU order; a workflow's pins are
  released when it ends;
- below the device: LRU (write-back on eviction, as HiCache / LMCache).
Simplified: no program-level FCFS scheduling (the engine's queue is kept as it is); the tool's
identity is approximated by the agent that called it; costs are per token, not per request.
"""

from __future__ import annotations

import heapq
from collections import deque

from pbkv.cache import Node, Tier
from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest

WINDOW = 64                  # pauses remembered per agent
RECOMPUTE_TOKEN_S = 2.5e-4   # default seconds to recompute one token (overridden by the bench)
LOAD_TOKEN_S = 2.0e-5        # default seconds to load one token from host
COLD_TTL = 1.0               # seconds, before any pause was observed


class ContinuumPolicy(Policy):
    name = "continuum"

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.recompute_s = ctx.recompute_token_seconds or RECOMPUTE_TOKEN_S
        self.load_s = ctx.load_token_seconds or LOAD_TOKEN_S
        self.pauses: dict[str, deque] = {}
        self.ended: dict[int, tuple[str, float]] = {}    # workflow -> (agent, end time) while paused
        self.started: dict[int, float] = {}              # workflow -> submit time of its running call
        self.call_mean = 0.0
        self.expiry: list[tuple[float, int, Node]] = []  # (until, node id, node)

    # ---------------------------------------------------------------- ranking

    def priority(self, node: Node) -> tuple:
        pin = node.policy_data
        return (1 if node.tier == Tier.DEVICE and pin is not None and pin[0] > self.clock() else 0,
                node.last_access)

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        self._expire()

    # ---------------------------------------------------------------- events

    def on_call_start(self, event: CallEvent) -> None:
        self._expire()
        paused = self.ended.pop(event.workflow, None)
        if paused is not None:
            self.pauses.setdefault(paused[0], deque(maxlen=WINDOW)).append(event.now - paused[1])
        self.started[event.workflow] = event.now

    def on_call_end(self, event: CallEvent) -> None:
        self._expire()
        start = self.started.pop(event.workflow, None)
        if start is not None:
            self.call_mean += 0.05 * ((event.now - start) - self.call_mean)
        self.ended[event.workflow] = (event.agent, event.now)
        ttl = self.ttl(event.agent) if event.workflow is not None else 0.0  # no program, no next turn
        if ttl > 0:
            self._pin(event.workflow, event.node, event.now + ttl)

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        self.ended.pop(workflow, None)
        self.started.pop(workflow, None)
        for node in nodes:  # the program is over: nothing of it waits for a next turn
            if node.policy_data is not None and node.policy_data[1] == workflow:
                node.policy_data = None
                self.cache.refresh(node)
        self._expire()

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        self._expire()  # decode rounds are the engine's heartbeat: expire pins on time
        return []

    # ---------------------------------------------------------------- TTL

    def ttl(self, agent: str) -> float:
        """Seconds to keep a path pinned after `agent`'s call ends (0: no pin)."""
        seen = self.pauses.get(agent)
        if not seen:
            return COLD_TTL + self.call_mean
        reload_s = min(self.recompute_s, self.load_s) if self.cache.capacity.host > 0 else self.recompute_s
        hold = 1.0 / self.cache.capacity.device
        pauses = sorted(seen)
        n = len(pauses)
        best_tau, best_u, below = None, 0.0, 0.0
        for i, tau in enumerate(pauses):
            below += tau
            u = (i + 1) / n * reload_s - hold * (below + tau * (n - i - 1)) / n
            if u > best_u:
                best_tau, best_u = tau, u
        return 0.0 if best_tau is None else best_tau + self.call_mean

    # ---------------------------------------------------------------- pins

    def _pin(self, workflow: int, node: Node, until: float) -> None:
        root = self.cache.tree.root
        while node is not root:
            pin = node.policy_data
            if pin is None or pin[0] < until:
                node.policy_data = (until, workflow)
                heapq.heappush(self.expiry, (until, node.id, node))
                self.cache.refresh(node)
            node = node.parent

    def _expire(self) -> None:
        now = self.clock()
        heap = self.expiry
        while heap and heap[0][0] <= now:
            until, _, node = heapq.heappop(heap)
            pin = node.policy_data
            if node.alive and pin is not None and pin[0] == until:
                node.policy_data = None
                self.cache.refresh(node)
