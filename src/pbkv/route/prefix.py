"""prefix: the longest cached prefix of the prompt, minus a penalty per queued request.

score(r) = cached tokens on r - load_penalty_tokens * load(r); the highest score wins (ties:
lower load, fewer workflows held, then the earliest replica). With no prefix cached anywhere
this is least-load. The same trade the SGLang router, llm-d's prefix scorer and Ray's
PrefixCacheAffinityRouter make, as one linear score instead of thresholds.
"""

from __future__ import annotations

from typing import Sequence

from pbkv.route.base import ReplicaView, RouteDecision, RouteRequest, Router, argmin, cached


class PrefixRouter(Router):
    name = "prefix"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        penalty = self.config.load_penalty_tokens
        view = argmin(replicas, lambda v: (-(cached(v, request) - penalty * v.load), v.load))
        return RouteDecision(view.id, reason=f"prefix {cached(view, request)} tokens, load {view.load:g}")
