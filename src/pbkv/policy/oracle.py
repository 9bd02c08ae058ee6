"""Oracle: Belady's rule with the replayed trace's future (an upper reference, not a product).

- evict the node whose next use is farthest away (never used again: first), ties by LRU;
- keep an evicted node in the next tier only if it will be used again;
- prefetch into free device space the host nodes needed soonest (never evicting for it).
Next-use times are `Future`'s estimates (see there); a workflow's nodes are re-ranked after
each of its calls, when its estimates move.
"""

from __future__ import annotations

from pbkv.cache import Node, Tier
from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest


class OraclePolicy(Policy):
    name = "oracle"
    reads_future = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        if ctx.future is None:
            raise ValueError("the oracle policy needs the replayed trace's future (PolicyContext.future)")
        self.future = ctx.future
        self.host_nodes: dict[int, Node] = {}  # nodes below the device, prefetch candidates
        self.ids: dict[int, str] = {}

    def priority(self, node: Node) -> tuple:
        return (-self.future.next_use(node.blocks[0]), node.last_access)

    def keep_on_evict(self, node: Node) -> bool:
        return self.future.next_use(node.blocks[0]) != float("inf")

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        if dst is None or not node.alive:
            self.host_nodes.pop(node.id, None)
        else:
            self.host_nodes[node.id] = node

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self.ids[workflow] = workflow_id
        self.future.started(workflow_id, self.clock())

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        self.future.ended(self.ids.pop(workflow))
        for node in nodes:
            self.cache.refresh(node)

    def on_call_end(self, event: CallEvent) -> None:
        # A call counts as a future use until it has been served (it may wait in the queue).
        self.future.call_ended(event.call.workflow_id, event.call.step, event.now)
        for node in self.cache.tree.workflow_nodes.get(event.workflow, {}).values():
            if node.alive:
                self.cache.refresh(node)

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        if request.free_tokens <= 0:  # it never evicts for a prefetch: nothing could load
            return []
        live = [n for n in self.host_nodes.values() if n.alive and n.tier != Tier.DEVICE]
        self.host_nodes = {n.id: n for n in live}
        free = request.free_tokens  # a node larger than the free space cannot load (no eviction)
        soon = sorted((self.future.next_use(n.blocks[0]), n.id, n) for n in live if n.tokens <= free)
        return [n for v, _, n in soon if v != float("inf")]
