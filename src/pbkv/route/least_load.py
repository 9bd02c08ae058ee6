"""least-load: the replica with the fewest queued and running requests (ties: earliest)."""

from __future__ import annotations

from typing import Sequence

from pbkv.route.base import ReplicaView, RouteDecision, RouteRequest, Router, argmin


class LeastLoadRouter(Router):
    name = "least-load"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        view = argmin(replicas, lambda v: v.load)
        return RouteDecision(view.id, reason=f"load {view.load:g}")
