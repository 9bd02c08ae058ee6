"""The policy interface: how to rank cache nodes, what to keep, what to load ahead.

A policy is a small class. The cache calls `priority` (smaller is evicted first; ties fall to
the node id, so orders are deterministic), `keep_on_evict` and `on_evict`; the engine calls the
event hooks and, while it runs decode-only batches, `prefetch`. Every hook defaults to a no-op,
and the default ranking is LRU, so a policy only writes the rules that differ.

A policy whose ranking changes without the node changing (new predictions, a workflow ending)
must call `self.cache.refresh(node)` for each node whose key moved: keys are computed when a
node enters the eviction index, not on every comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pbkv.cache import Node, Tier, TieredCache

if TYPE_CHECKING:
    from pbkv.policy.future import Future
    from pbkv.trace import Call


@dataclass
class PolicyContext:
    """What a policy may know when it is built.

    `agent_graph` is the static workflow graph (agent -> possible next agents, with "START" and
    "END"), known to a developer who wrote the workflow; `static_sequence` is the agent order
    when the workflow is static; `future` is the replayed trace's future, only for policies that
    read it (oracle, pbkv-perfect); `predictors` maps a variant name ("fused", "history",
    "context") to a trained predictor.

    Tuning: `horizon` is the steps ahead a predicting policy scores (None: its predictor's; must
    not exceed it); `gamma` the per-step discount of pbkv's reuse score; `kvflow_horizon` the
    steps-to-execution cap of kvflow; `scalesim_horizon` the invocation-distance cap of scalesim;
    `online_learner` (pbkv.predict.online.OnlineLearner or the server's TrafficLearner) hears
    finished workflows and hands back retrained predictors.

    Costs (from the engine's cost model; None when the engine has none): `recompute_token_seconds`
    and `load_token_seconds`, what one token costs to recompute or to load back from host."""

    block_size: int = 16
    agent_graph: dict[str, list[str]] = field(default_factory=dict)
    static_sequence: list[str] | None = None
    future: Future | None = None
    predictors: dict = field(default_factory=dict)
    horizon: int | None = None
    gamma: float = 0.8
    kvflow_horizon: int = 5
    scalesim_horizon: int = 5
    online_learner: object = None
    recompute_token_seconds: float | None = None
    load_token_seconds: float | None = None


@dataclass
class CallEvent:
    """A call starting or ending: who made it and the deepest node of its prompt's cached path.

    `hidden` is the serving model's hidden state at the call's last prompt token (a 1-D float
    array), known once its prefill ran: a real engine sets it in `on_prefill` and `on_call_end`
    events; it is None in `on_call_start` and in the simulator (which has no model).

    `now` is the event's time. For `on_call_start` it is when the call was issued, which in the
    simulator may be earlier than the engine's clock (a call that arrived during a prefill pass)."""

    workflow: int
    agent: str
    step: int
    call: Call
    node: Node
    now: float
    hidden: object = None


@dataclass
class PrefetchRequest:
    """An idle moment for host-to-device loads: the engine runs a decode-only batch.

    `budget_tokens` is what the link can move during this batch; `free_tokens` is the device
    space nobody holds. A policy returns nodes (in slower tiers) to load, best first; the engine
    loads each with its not-yet-resident ancestors while budget and space last."""

    budget_tokens: int
    free_tokens: int
    now: float


class Policy:
    """Base class: LRU ranking, keep everything on eviction, no prefetch, no-op hooks."""

    name = "base"
    allow_evict_for_prefetch = False  # may a prefetch evict resident nodes to make room?

    def __init__(self, ctx: PolicyContext):
        self.ctx = ctx
        self.cache: TieredCache | None = None
        self.clock: Callable[[], float] = lambda: 0.0

    def bind(self, cache: TieredCache, clock: Callable[[], float] | None = None) -> None:
        """Attach the cache this policy ranks for, and the engine's clock (time is injected)."""
        self.cache = cache
        if clock is not None:
            self.clock = clock

    # ranking (called by the cache)
    def priority(self, node: Node) -> tuple:
        return (node.last_access,)

    def keep_on_evict(self, node: Node) -> bool:
        return True

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        pass

    # events (called by the engine)
    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        pass

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        """`nodes`: the live nodes the workflow touched (their tags no longer name it)."""

    def on_call_start(self, event: CallEvent) -> None:
        pass

    def on_prefill(self, event: CallEvent) -> None:
        """A real engine finished the call's prefill; `event.hidden` is the context signal."""

    def on_call_end(self, event: CallEvent) -> None:
        pass

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        return []

    def prefetch_floor(self, node: Node) -> tuple | None:
        """With `allow_evict_for_prefetch`: the eviction key below which room may be made to
        load `node` ahead of use (None: any resident node may go, in this policy's order)."""
        return None

    # advice (read by a router)
    def reuse_probability(self, workflow: int) -> float | None:
        """Predicted probability that `workflow` calls again after the call it is about to make,
        and so reads the KV that call leaves here (None: no prediction; a router assumes 1)."""
        return None

    def refresh_live(self, nodes: dict[int, Node]) -> None:
        """Re-rank every live node of an index the policy keeps (node id -> node), dropping the
        entries of nodes that left the tree."""
        for node_id in [i for i, n in nodes.items() if not n.alive]:
            del nodes[node_id]
        for node in nodes.values():
            self.cache.refresh(node)


PolicyFactory = Callable[[PolicyContext], Policy]
