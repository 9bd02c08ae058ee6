"""round-robin: the i-th call goes to replica i mod n (n = replicas given at that call)."""

from __future__ import annotations

from typing import Sequence

from pbkv.route.base import ReplicaView, RouteDecision, RouteRequest, Router, require


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        require(replicas)
        view = replicas[self.calls % len(replicas)]
        self.calls += 1
        return RouteDecision(view.id, reason="round-robin")
