"""pbkv's routers as a Ray Serve `RequestRouter` (needs `pbkv[scale]`: ray[serve]).

Use it on a deployment whose replicas define `record_routing_stats` returning
`ReplicaSnapshot.to_stats()` (plus a changing `seq`), and whose requests carry pbkv hints
(see `pbkv.scale.adapter`):

    RequestRouterConfig(request_router_class="pbkv.scale.ray_router:PBKVRequestRouter",
                        request_router_kwargs={"router": "pbkv", "config": {...RouterConfig fields}},
                        request_routing_stats_period_s=1.0)

`choose_replicas` returns the replica the pbkv router chose as the only rank, so Ray waits
(with backoff) for that replica when it is full or slow to report its queue, instead of
breaking the affinity the router chose; a replica that died is no longer a candidate, so its
calls are placed again. With `fallback=True` every other replica forms a second rank (Ray then
takes the least-loaded of them when the chosen one does not answer in time). A request without
hints goes to every candidate at once (Ray's least-queue choice). A hints dict may name replicas
to `avoid` (the ingress's retry after a replica was lost): they are left out while another
candidate remains.
Loads come from Ray's queue-length cache when it has a fresh entry, else from the report.
KV movement: a decision to fetch a prefix from another replica is written into the call's hints
(`adapter.mark_fetch`); replicas that can act on it (`pbkv serve --replicas`: `scale/replica.py`)
ask the source for the blocks with a call pinned to it (`{"pin": id}`: that replica alone is
returned, or every candidate when it is gone). Other deployments cannot, so `can_fetch` defaults
to False here (the router then never plans a transfer); `pbkv serve --replicas` sets it.
Set `config` to the replicas' real costs (a CPU model prefills ~1000x slower than a GPU one), or
pass `measured_costs=True`: the prefill and KV-transfer costs then follow what the replicas
measured and report (`adapter.measured_config`; `config` stands until a replica reports).
Ray pickles this module BY VALUE (`RequestRouterConfig` registers it so): module-level state here
would be copied into every deployment, so the process-wide registry of routers (for
`decision_seconds`) lives in `pbkv.scale.adapter`, which is pickled by reference.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pbkv.route import BadDecision, RouterConfig, check_decision, make_router
from pbkv.scale.adapter import (Overlay, dict_args, hinted_call, hints_dict, mark_fetch, measured_config,
                                pinned, register_router, with_reported_reuse)
from pbkv.scale.llm_hints import TextChunks

log = logging.getLogger(__name__)


class PBKVRequestRouter(RequestRouter):
    def initialize_state(self, router: str = "pbkv", config: dict | None = None, fallback: bool = False,
                         chunk_chars: int = 64, chars_per_token: int = 4, measured_costs: bool = False, **_):
        self.decision_s: deque[float] = deque(maxlen=10_000)   # seconds per hinted decision (the latest)
        register_router(self)
        self.fallback = fallback
        self.chunks = TextChunks(chunk_chars, chars_per_token)
        self.base_config = RouterConfig(**({"can_fetch": False} | (config or {})))
        self.measured_costs = measured_costs
        self.pbkv_router = make_router(router, self.base_config)
        self.overlay = Overlay()
        self.decisions: dict[str, int] = {}

    def _views(self, candidates: List[RunningReplica]):
        cache = self.replica_queue_len_cache
        views = []
        for r in sorted(candidates, key=lambda r: r.replica_id.unique_id):
            rid = r.replica_id.unique_id
            views.append(self.overlay.view(rid, r.routing_stats, cache.get(r.replica_id)))
        return views

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not hasattr(self, "pbkv_router"):   # Ray did not call initialize_state (no kwargs given)
            self.initialize_state()
        pin = None if pending_request is None else pinned(pending_request.args, pending_request.kwargs)
        if pin is not None:   # a replica asks that one for KV; if it is gone, any other answers
            # (keys name content: another replica's blocks under them are as good, or it has none)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin] or candidate_replicas]
        call = None if pending_request is None else self._call(pending_request)
        if call is None or not candidate_replicas:
            return [candidate_replicas]
        start = time.perf_counter()
        candidate_replicas = _without_avoided(candidate_replicas, pending_request)
        views = self._views(candidate_replicas)
        if self.measured_costs:
            stats = (r.routing_stats for r in candidate_replicas)
            self.pbkv_router.config = measured_config(self.base_config, stats)
        request = with_reported_reuse(call.route, views)
        decision = self.pbkv_router.choose(request, views)
        try:
            check_decision(self.pbkv_router, decision, request, views)
        except BadDecision:  # an out-of-tree router's mistake: Ray's own order, not a lost call
            log.exception("ignoring the router's decision")
            return [candidate_replicas]
        # remember the choice now, not only once Ray has sent the call: calls that arrive together
        # are chosen before any is sent, and would all see the same views and pick the same replica
        self.overlay.routed(decision.replica, call.route)
        hints = hints_dict(pending_request.args, pending_request.kwargs)
        if hints is not None:
            mark_fetch(hints, decision, views)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == decision.replica]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != decision.replica]
        self.decision_s.append(time.perf_counter() - start)
        return [chosen, rest] if rest and self.fallback else [chosen]

    def _call(self, pending_request: PendingRequest):
        """The request's hints, parsed once: the last request's are kept for `on_request_routed`
        (hashing a long prompt is the largest part of a routing decision)."""
        last = getattr(self, "_last", None)
        if last is not None and last[0] is pending_request:
            return last[1]
        call = hinted_call(pending_request.args, pending_request.kwargs, self.chunks)
        self._last = (pending_request, call)
        return call

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        call = self._call(pending_request)
        if call is not None:
            rid = replica_id.unique_id
            self.overlay.routed(rid, call.route)
            self.decisions[rid] = self.decisions.get(rid, 0) + 1
            if call.done:
                self.pbkv_router.on_workflow_end(call.route.workflow_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        self.overlay.forget(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)


def _without_avoided(candidates: List[RunningReplica], pending: PendingRequest) -> List[RunningReplica]:
    """The candidates minus the replicas the request's hints say to avoid, unless none would remain."""
    avoid = set()
    for value in dict_args(pending.args, pending.kwargs):
        avoid.update(str(a) for a in value.get("avoid") or ())
    kept = [r for r in candidates if r.replica_id.unique_id not in avoid]
    return kept or candidates
