"""KVFlow (arXiv 2507.07400): workflow-aware eviction by steps-to-execution, plus prefetch.

Rules, as in the KVFlow paper/repo (summarised in docs/design.md):
- a node used by two or more workflows is part of a *fixed* prompt; every other node is a
  workflow's *dynamic suffix* and is evicted first (LRU among suffixes);
- a fixed node's value is the minimum, over the agents that used it and over every active
  workflow, of that agent's steps-to-execution (`StepGraph`: exact positions for a static
  workflow, shortest paths in the agent graph otherwise); fixed nodes are evicted in
  descending steps (the agent needed last goes first), ties by LRU;
- prefetch: the fixed nodes of agents one step away for some workflow (every branch candidate)
  are loaded back from host, evicting by the same order when the device is full;
- the host tier is plain LRU (HiCache).
"""

from __future__ import annotations

from pbkv.cache import Node, Tier
from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest
from pbkv.policy.step_graph import START, StepGraph


class KVFlowPolicy(Policy):
    name = "kvflow"
    allow_evict_for_prefetch = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.graph = StepGraph(ctx.agent_graph, horizon=int(ctx.kvflow_horizon),
                               sequence=ctx.static_sequence)
        self.far = self.graph.horizon
        self.workflow_steps: dict[int, dict[str, int]] = {}  # active workflow -> agent -> steps
        self.counts: dict[str, list[int]] = {}  # agent -> number of workflows at each steps value
        self.min_steps: dict[str, int] = {}
        self.fixed_by_agent: dict[int, dict[int, Node]] = {}  # agent bit -> fixed nodes

    # ---------------------------------------------------------------- ranking

    def priority(self, node: Node) -> tuple:
        if node.tier != Tier.DEVICE or node.seen_workflows < 2:
            return (0, 0, node.last_access)
        return (1, -self._node_steps(node), node.last_access)

    def _node_steps(self, node: Node) -> int:
        best = self.far
        mask = node.agent_mask
        for agent, bit in self.cache.tree.agent_ids.items():
            if mask >> bit & 1:
                best = min(best, self.min_steps.get(agent, self.far))
        return best

    # ---------------------------------------------------------------- events

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self._set_steps(workflow, self.graph.steps_from(START))

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        self._set_steps(workflow, {})
        del self.workflow_steps[workflow]

    def on_call_start(self, event: CallEvent) -> None:
        steps = dict(self.graph.steps_from(event.agent, event.step))
        steps[event.agent] = 0  # running now
        self._set_steps(event.workflow, steps)
        self._register_fixed(event.node)

    def on_call_end(self, event: CallEvent) -> None:
        self._set_steps(event.workflow, self.graph.steps_from(event.agent, event.step))

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        wanted = []
        for agent, steps in self.min_steps.items():
            if steps != 1:
                continue
            bit = self.cache.tree.agent_ids.get(agent)
            for node in self.fixed_by_agent.get(bit, {}).values():
                if node.alive and node.tier != Tier.DEVICE and node.lock == 0:
                    wanted.append(node)
        return wanted

    # ---------------------------------------------------------------- bookkeeping

    def _register_fixed(self, node: Node) -> None:
        """Index the fixed nodes on this path by agent so a change of steps re-ranks them."""
        tree = self.cache.tree
        while node is not tree.root and node.seen_workflows >= 2:
            known = node.policy_data or 0
            if known != node.agent_mask:
                for agent, bit in tree.agent_ids.items():
                    if (node.agent_mask & ~known) >> bit & 1:
                        self.fixed_by_agent.setdefault(bit, {})[node.id] = node
                node.policy_data = node.agent_mask
            node = node.parent

    def _set_steps(self, workflow: int, steps: dict[str, int]) -> None:
        old = self.workflow_steps.get(workflow, {})
        changed = []
        for agent in dict.fromkeys([*old, *steps]):  # ordered: runs are deterministic
            before, after = old.get(agent), steps.get(agent)
            if before == after:
                continue
            counts = self.counts.setdefault(agent, [0] * (self.far + 1))
            if before is not None:
                counts[before] -= 1
            if after is not None:
                counts[after] += 1
            new_min = next((s for s, c in enumerate(counts) if c), self.far)
            if new_min != self.min_steps.get(agent, self.far):
                self.min_steps[agent] = new_min
                changed.append(agent)
        self.workflow_steps[workflow] = steps
        for agent in changed:
            self._refresh_agent(agent)

    def _refresh_agent(self, agent: str) -> None:
        bit = self.cache.tree.agent_ids.get(agent)
        nodes = self.fixed_by_agent.get(bit)
        if nodes:
            self.refresh_live(nodes)
