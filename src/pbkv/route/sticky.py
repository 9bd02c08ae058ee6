"""sticky: a workflow's first call goes to the least-loaded replica; its later calls follow it.

A workflow whose replica disappeared (not among the views) is placed again, least-load. Like
session affinity in a load balancer; the router forgets a workflow when it ends.
Invariant: it remembers at most `max_workflows` workflows; past that the least recently routed
one is forgotten first (a workflow that ends by an idle timeout is never announced to the
router), and is placed again, least-load, if it calls again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pbkv.route.base import ReplicaView, RouteDecision, RouteRequest, Router, argmin


class StickyRouter(Router):
    name = "sticky"
    max_workflows = 100_000

    def __init__(self, config=None):
        super().__init__(config)
        self.home: OrderedDict[str, str] = OrderedDict()   # least recently routed first

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        home = self.home.get(request.workflow_id)
        for v in replicas:
            if v.id == home:
                self.home.move_to_end(request.workflow_id)
                return RouteDecision(v.id, reason="sticky")
        view = argmin(replicas, lambda v: v.load)
        self._remember(request.workflow_id, view.id)
        return RouteDecision(view.id, reason="placed" if home is None else f"placed again ({home} gone)")

    def _remember(self, workflow_id: str, replica: str) -> None:
        self.home[workflow_id] = replica
        self.home.move_to_end(workflow_id)
        while len(self.home) > self.max_workflows:
            self.home.popitem(last=False)

    def on_workflow_end(self, workflow_id: str) -> None:
        self.home.pop(workflow_id, None)
