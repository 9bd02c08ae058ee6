"""pbkv: place each call where it finishes soonest, counting the KV it reuses now and later.

For every replica r the router estimates, in seconds (costs from `RouterConfig`):

    queue(r)   = queue_s_per_request * queued(r), where queued is the view's `queued` (requests
                 waiting for admission) when it has one, else its `load`: in continuous
                 batching a running request hardly delays a new one, a waiting one does
    prefill(r) = recompute of the prompt tokens r cannot reuse; if another replica s caches a
                 longer prefix, the extra `gain` tokens are fetched from s instead, but only when
                 transfer_s(gain) < recompute_s(gain) (moving KV must beat recomputing it)
    strand(r)  = p * recompute_s(t) where t = the workflow's KV on its home replica (the one
                 holding most of it) that this call leaves behind when r is not that home, and
                 p = the predicted probability the workflow reads its KV again
                 (`reuse_probability`; 1 when unknown, and a hint that is not a real number in
                 [0, 1] is unknown). Stranded KV is charged as recomputed: later calls find it
                 only if a router fetches it back, and meanwhile it takes space on both replicas
                 (measured in the simulator: charging only a transfer made the router move
                 workflows so often that it lost to `sticky`)

and picks the smallest queue + prefill + strand (ties: fewer workflows held, then earliest).
A workflow whose KV is unlikely to be reused (p near 0) is placed by load and prefix alone; one
likely to continue stays home unless waiting there costs more than what it leaves behind.

A workflow no replica holds KV of (its first call, or all its KV was evicted) goes to the
cheapest of the replicas holding the fewest workflows, and of those holding at most
`NEW_WORKFLOW_SLACK` (1) more that cache a longer prefix of its prompt than any of the fewest
does. Why the count: placing a workflow commits its later calls too (they follow their KV home),
and with no prediction of a workflow's size every active workflow is expected to bring the same
future load, so the count of workflows held is the expected future load; the call's own queue +
prefill (seconds, only this call) alone would let a replica that merely cached the agents'
prompts first attract every new workflow. Measured in the simulator (hover and swe, 16/48
clients, 2-8 instances, 400 workflows): pbkv's worst latency over the best other router's fell
from 1.019 to 1.008 (seed 0) and from 1.008 to 1.005 (seed 1); docs/scale-out.md. Why the
exception: with the count alone a new workflow that continues a chat another replica holds (a
retry, a fork under a new id) lost that cached prefix whenever the counts were not tied (seen
with two vLLM replicas: `tests/test_ray_llm.py`); one workflow more is the smallest imbalance that
lets it follow the prefix. Letting every replica within one workflow compete on cost instead
(prefix or not) moved the simulator's worst ratios to 1.011 (seeds 0 and 1); with the exception
the simulator's figures are unchanged (agents' prompts are cached on every replica after the
first few calls, so the exception seldom applies there).
`warm` names the predicted next agent's prompt blocks the chosen replica lacks, so the engine
can load them before that call comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pbkv.route.base import (ReplicaView, RouteDecision, RouteRequest, Router, argmin, cached, home, require,
                             reuse_hint)


NEW_WORKFLOW_SLACK = 1   # a new workflow may go to a replica holding this many more workflows than the fewest


@dataclass(frozen=True)
class Estimate:
    seconds: float
    fetch_from: str | None
    fetch_tokens: int
    reuse_tokens: int


class PBKVRouter(Router):
    name = "pbkv"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        require(replicas)
        local = {v.id: cached(v, request) for v in replicas}
        home_view, home_tokens = home(request, replicas)
        home_id = None if home_view is None else home_view.id
        est = {v.id: self._estimate(request, v, replicas, local, home_id, home_tokens) for v in replicas}
        if home_id is None:   # a new workflow: fewest workflows held, unless its prefix lives elsewhere (docstring)
            view = argmin(replicas, self._new_workflow_key(replicas, local, est))
        else:
            view = argmin(replicas, lambda v: est[v.id].seconds)
        est = est[view.id]
        return RouteDecision(view.id, fetch_from=est.fetch_from, fetch_tokens=est.fetch_tokens,
                             warm=self._warm(request, view),
                             reason=f"{est.seconds:.4f}s: reuse {est.reuse_tokens}, fetch {est.fetch_tokens}, "
                                    f"load {view.load:g}")

    def _estimate(self, request, view, replicas, local, home, home_tokens) -> Estimate:
        cfg = self.config
        have = local[view.id]
        source, gain = None, 0
        for v in replicas:
            extra = local[v.id] - have
            if v.id != view.id and extra > gain:
                source, gain = v.id, extra
        if source is not None and cfg.transfer_s(gain) >= cfg.recompute_s(gain):
            source, gain = None, 0
        seconds = cfg.queue_s_per_request * getattr(view, "queued", view.load) + cfg.transfer_s(gain) \
            + cfg.recompute_s(request.input_tokens - have - gain)
        if home is not None and view.id != home:
            left = max(0, home_tokens - (gain if source == home else 0))
            # checked again here: a request built without RouteRequest's check must not raise either
            p = reuse_hint(request.reuse_probability)
            p = 1.0 if p is None else p
            seconds += p * cfg.recompute_s(left)
        return Estimate(seconds, source, gain, have + gain)

    @staticmethod
    def _new_workflow_key(replicas, local, est):
        """Sort key for a new workflow: replicas holding the fewest workflows, and those within
        `NEW_WORKFLOW_SLACK` of it that cache more of this prompt than any of the fewest, compete
        on the call's cost; all others come after, by count."""
        fewest = min(v.workflow_count for v in replicas)
        reuse = max(local[v.id] for v in replicas if v.workflow_count == fewest)
        def key(v):
            near = v.workflow_count == fewest or (v.workflow_count <= fewest + NEW_WORKFLOW_SLACK and local[v.id] > reuse)
            return (0 if near else v.workflow_count, est[v.id].seconds)
        return key

    def _warm(self, request, view) -> tuple[int, ...]:
        if not request.next_prefix:
            return ()
        have = view.cached_prefix_tokens(request.next_prefix) // self.config.block_size
        return tuple(request.next_prefix[have:])
