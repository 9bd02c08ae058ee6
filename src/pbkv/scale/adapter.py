"""From a serving request and replicas' `routing_stats` to a pbkv router's input. No Ray here.

A replica reports `ReplicaSnapshot.to_stats()` (cached block ids, workflow token counts, load)
every few seconds; between two reports the router would be blind to what it just placed. The
`Overlay` remembers, per replica, the prompts and workflows routed there since, so a workflow's
second call finds its first one at once. What was routed is kept until the second new report
(its `seq` changed) after it: the first may have been taken before the call reached the replica
(or, with `pbkv serve --replicas`, before its prefill stored the KV), and dropping the call then
made the workflow look new, so its next call could be placed elsewhere (seen as a flaky move in
`tests/test_ray_serve_replicas.py`); the report after that was asked for after the first arrived.
Blocks a replica evicted linger for at most those two reports. The overlay is also bounded
(`max_blocks` per replica; when full it is cleared, costing routing quality until the next report).

Requests carry pbkv's hints as a dict (`workflow_id`, `agent`, `hash_ids`, `input_tokens`, and
optionally `output_tokens`, `reuse_probability`, `next_prefix`, `done`: the call ends its
workflow, and the router forgets the workflow once it placed it; without a `reuse_probability`,
`with_reported_reuse` takes the one the workflow's home replica reported); `route_request` finds
that dict among a call's arguments and returns None for anything else (routed as plain load
balancing).
`hinted_call` also reads Ray Serve LLM's OpenAI request objects (`pbkv.scale.llm_hints`).

KV movement (`mark_fetch`, `pinned`): when the router's decision says to fetch a prefix from
another replica, the hints dict gains `fetch` = {"from": replica id, "first": blocks the chosen
replica already caches, "blocks": blocks to move}, which the chosen replica acts on before it
queues the call (`pbkv.scale.replica`); its request for the blocks names that replica in a `pin`
dict, which the Ray router honours as it is (`pinned`).

Measured costs (`measured_config`): a replica may report `costs` in its stats, the rates it
measured (`MEASURED`: seconds per prefilled token from its engine, seconds per token of KV it
fetched from another replica); the router's costs then follow the median over the replicas that
report each one, the configured value standing where none does.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from pbkv.route import ReplicaSnapshot, RouteRequest, RouterConfig
from pbkv.route.base import home
from pbkv.scale.llm_hints import LLMCall, TextChunks, find_llm_call


def dict_args(args: Iterable, kwargs: Mapping | None = None) -> Iterator[Mapping]:
    """A call's arguments, then its keyword values, that are dicts (where hints travel)."""
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, Mapping):
            yield value


def hints_dict(args: Iterable, kwargs: Mapping | None = None) -> Mapping | None:
    """The first argument (or keyword value) that is a dict with `workflow_id` and `hash_ids`."""
    return next((d for d in dict_args(args, kwargs) if "workflow_id" in d and "hash_ids" in d), None)


def pinned(args: Iterable, kwargs: Mapping | None = None) -> str | None:
    """The replica id a call names in a `{"pin": id}` dict argument (a replica's request for KV
    from one given replica), else None."""
    pin = next((d for d in dict_args(args, kwargs) if "pin" in d and "hash_ids" not in d), None)
    return None if pin is None else str(pin["pin"])


def mark_fetch(hints: dict, decision, views: "list[MergedView]") -> None:
    """Write the decision's KV move into the call's hints dict (`fetch`, see the module
    docstring); remove one left from an earlier decision when there is none now."""
    hints.pop("fetch", None)
    chosen = next((v for v in views if v.id == decision.replica), None)
    if chosen is None or decision.fetch_from is None:
        return
    block_size = chosen.base.block_size
    if decision.fetch_tokens < block_size:
        return
    first = chosen.cached_prefix_tokens(hints["hash_ids"]) // block_size
    hints["fetch"] = {"from": decision.fetch_from, "first": first, "blocks": decision.fetch_tokens // block_size}


def route_request(args: Iterable, kwargs: Mapping | None = None) -> RouteRequest | None:
    """The hints dict's request (`hints_dict`), or None."""
    value = hints_dict(args, kwargs)
    if value is None:
        return None
    hash_ids = tuple(int(h) for h in value["hash_ids"])
    return RouteRequest(workflow_id=str(value["workflow_id"]), agent=str(value.get("agent", "")),
                        hash_ids=hash_ids,
                        input_tokens=int(value.get("input_tokens", 16 * len(hash_ids))),
                        output_tokens=int(value.get("output_tokens", 0)),
                        reuse_probability=value.get("reuse_probability"),
                        next_prefix=tuple(int(h) for h in value.get("next_prefix", ())))


def with_reported_reuse(request: RouteRequest, views: "list[MergedView]") -> RouteRequest:
    """`request`, when its client sent no `reuse_probability`, with the one the workflow's home
    replica (the view holding most of its KV) last reported: that replica's policy predicts it
    from the workflow's calls, which a client seldom can. Unchanged when no replica reported one
    (the router then assumes 1)."""
    if request.reuse_probability is not None:
        return request
    view, _ = home(request, views)
    p = None if view is None else view.reuse_probability(request.workflow_id)
    return request if p is None else dataclasses.replace(request, reuse_probability=p)


MEASURED = ("prefill_s_per_token", "transfer_s_per_token")   # RouterConfig fields replicas may measure


def measured_config(base: RouterConfig, stats: Iterable[Mapping | None]) -> RouterConfig:
    """`base` with each `MEASURED` cost set to the median of the positive values the replicas'
    `stats` report under `costs` (unchanged where none reports one)."""
    reported: dict[str, list[float]] = {name: [] for name in MEASURED}
    for s in stats:
        costs = (s or {}).get("costs") or {}
        for name in MEASURED:
            value = costs.get(name)
            if isinstance(value, (int, float)) and value > 0:
                reported[name].append(float(value))
    changes = {name: _median(values) for name, values in reported.items() if values}
    return dataclasses.replace(base, **changes) if changes else base


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def hinted_call(args: Iterable, kwargs: Mapping | None = None, chunks: TextChunks = TextChunks()) -> LLMCall | None:
    """A call's hints: a pbkv hints dict (`route_request`; it ends its workflow when its `done` is
    true), else a Ray Serve LLM chat/completion request with a workflow id (`find_llm_call`), else None."""
    args = list(args)
    request = route_request(args, kwargs)
    if request is not None:
        return LLMCall(request, done=hints_dict(args, kwargs).get("done") is True)
    return find_llm_call(args, kwargs, chunks)


class MergedView:
    """A replica's last report plus what was routed there in the overlay's two generations (a
    `ReplicaView`); reads the sets per lookup instead of copying them, so a view costs O(prompt),
    not O(cache)."""

    def __init__(self, base: ReplicaSnapshot, routed: "list[Routed]", load: float | None):
        self.id, self.base, self.routed = base.id, base, routed
        self.load = base.load if load is None else float(load)

    def _has(self, h: int) -> bool:
        return h in self.base.blocks or any(h in g.blocks for g in self.routed)

    def cached_prefix_tokens(self, hash_ids) -> int:
        n = 0
        for h in hash_ids:
            if not self._has(h):
                break
            n += 1
        return n * self.base.block_size

    def workflow_tokens(self, workflow_id: str) -> int:
        return max([self.base.workflow_tokens(workflow_id)] + [g.workflows.get(workflow_id, 0) for g in self.routed])

    def reuse_probability(self, workflow_id: str) -> float | None:
        return self.base.reuse_probability(workflow_id)

    @property
    def workflow_count(self) -> int:
        names = set(self.base.workflows)
        for g in self.routed:
            names.update(g.workflows)
        return len(names)


@dataclass
class Routed:
    """Calls routed to one replica between two of its reports: prompt blocks, workflow -> tokens."""

    blocks: set[int] = field(default_factory=set)
    workflows: dict[str, int] = field(default_factory=dict)


@dataclass
class Overlay:
    """What was routed to each replica, kept for two of its reports (see the module docstring).
    Invariant: per replica at most two generations (since the last report, and the one before),
    holding together at most `max_blocks` block ids."""

    max_blocks: int = 200_000
    recent: dict[str, Routed] = field(default_factory=dict)    # routed since the last report
    older: dict[str, Routed] = field(default_factory=dict)     # routed between the two last reports
    reports: dict[str, tuple[object, ReplicaSnapshot]] = field(default_factory=dict)

    def routed(self, replica: str, request: RouteRequest) -> None:
        older = self.older.get(replica)
        gen = self.recent.get(replica)
        held = (len(gen.blocks) if gen else 0) + (len(older.blocks) if older else 0)
        if held + len(request.hash_ids) > self.max_blocks:
            self.forget(replica)
            gen = None
        if gen is None:
            gen = self.recent[replica] = Routed()
        gen.blocks.update(request.hash_ids)
        gen.workflows[request.workflow_id] = max(gen.workflows.get(request.workflow_id, 0),
                                                 request.input_tokens + request.output_tokens)

    def forget(self, replica: str) -> None:
        self.recent.pop(replica, None)
        self.older.pop(replica, None)

    def view(self, replica: str, stats: Mapping | None, load: float | None) -> MergedView:
        """The replica's last report merged with what was routed there since the report before it;
        `load` (a fresher queue length, e.g. Ray's cache) replaces the reported one when known. A
        report is parsed once (per `seq`; reports without one are parsed every time)."""
        stats = stats or {}
        seq = stats.get("seq")
        known = self.reports.get(replica)
        if seq is None or known is None or known[0] != seq:
            if seq is not None and known is not None:   # a new report: the generations move on
                self.older[replica] = self.recent.pop(replica, Routed())
            known = (seq, ReplicaSnapshot.from_stats(dict(stats), replica_id=replica))
            self.reports[replica] = known
        routed = [g for g in (self.recent.get(replica), self.older.get(replica)) if g is not None]
        return MergedView(known[1], routed, load)


_ROUTERS: "weakref.WeakSet" = weakref.WeakSet()   # this process's Ray routers (see `decision_seconds`)
# app name -> its newest router in this process (see `running_replicas`): a newer one (a new handle,
# a new Ray session) supersedes routers of earlier sessions that something may still hold
_NEWEST: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def register_router(router) -> None:
    """Called by each `PBKVRequestRouter` (it keeps `decision_s`, seconds per routing decision)."""
    _ROUTERS.add(router)
    app = _app_of(router)
    if app is not None:
        _NEWEST[app] = router


def decision_seconds(clear: bool = False) -> list[float]:
    """How long each of the latest (up to 10 000 per router) hinted routing decisions took in this
    process's routers (the process holding the deployment handle), sorted; `clear` empties them."""
    routers = list(_ROUTERS)
    out = sorted(t for r in routers for t in r.decision_s)
    if clear:
        for r in routers:
            r.decision_s.clear()
    return out


def workflow_ended(app_name: str | None, workflow_id: str) -> None:
    """Tells this process's routers of the app `app_name` that `workflow_id` ended (a workflow end
    that no call carried: `POST /v1/workflows/{id}/end`), so they forget it."""
    for router in list(_ROUTERS):
        inner = getattr(router, "pbkv_router", None)
        if inner is not None and _app_of(router) == app_name:
            inner.on_workflow_end(workflow_id)


def running_replicas(app_name: str) -> int | None:
    """Replicas of the app `app_name` that this process's (newest) router of it knows to be running
    (Ray's controller tells it of each change; it also drops a replica as soon as a call finds it
    dead); None when this process has no router of that app. No remote call: cheap enough for every
    /health probe, and it cannot hang on a stuck replica."""
    router = _NEWEST.get(app_name)
    return None if router is None else len(router.curr_replicas)


def _app_of(router) -> str | None:
    try:
        return router.app_name
    except AttributeError:   # a router built without Ray's constructor (unit tests)
        return None
