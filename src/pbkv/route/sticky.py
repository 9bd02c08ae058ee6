"""sticky: a workflow's first call goes to the least-loaded replica; its later calls follow it.

A workflow whose replica disappeared (not among the views) is placed again, least-load. Like
session affinity in a load balancer; the router forgets a workflow when it ends.
"""

from __future__ import annotations

from typing import Sequence

from pbkv.route.base import ReplicaView, RouteDecision, RouteRequest, Router, argmin


class StickyRouter(Router):
    name = "sticky"

    def __init__(self, config=None):
        super().__init__(config)
        self.home: dict[str, str] = {}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        home = self.home.get(request.workflow_id)
        for v in replicas:
            if v.id == home:
                return RouteDecision(v.id, reason="sticky")
        view = argmin(replicas, lambda v: v.load)
        self.home[request.workflow_id] = view.id
        return RouteDecision(view.id, reason="placed" if home is None else f"placed again ({home} gone)")

    def on_workflow_end(self, workflow_id: str) -> None:
        self.home.pop(workflow_id, None)
