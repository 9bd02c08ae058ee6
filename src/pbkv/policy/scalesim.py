"""ScaleSim: evict by invocation distance, prefetch the agents invoked next.

Source: ScaleSim (arXiv 2601.21473; code with KVFlow's, github.com/PanZaifeng/KVFlow). Each
agent's "invocation distance" (how many calls until it next calls the LLM) drives priority
eviction on the GPU and the prefetch of the nearest agents' KV from host memory.

Here (`invocation.py` computes the distances):
- per active workflow: the expected distance of every agent from the agent it called last
  (0 for the agent running now), learned online from observed transitions;
- a node shared by two or more workflows (an agent's fixed prompt) is worth the nearest
  distance, over its agents and every active workflow; a private node the nearest distance over
  the agents its own workflows used it for; nodes of no active workflow are `horizon` away;
- device eviction: farthest distance first (quantised to half steps), ties LRU; below the
  device: LRU (HiCache);
- prefetch: nodes below the device within one step, nearest first, deeper first among equals.
Simplified: no simulation of the agents' tool times (ScaleSim estimates the time of the next
invocation, we count calls); distances of shared nodes are refreshed only when an agent's
nearest distance moves by a half step.
"""

from __future__ import annotations

from pbkv.cache import Node, Tier
from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest
from pbkv.policy.invocation import InvocationDistance
from pbkv.policy.reuse_score import bits
from pbkv.policy.step_graph import END, START

QUANTUM = 2  # distances are ranked in 1/QUANTUM steps


class ScaleSimPolicy(Policy):
    name = "scalesim"
    allow_evict_for_prefetch = True

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.far = ctx.scalesim_horizon
        self.dist = InvocationDistance(ctx.agent_graph, self.far, ctx.static_sequence)
        self.last: dict[int, str] = {}                     # workflow -> agent called last
        self.wf_dist: dict[int, dict[str, float]] = {}     # workflow -> agent -> distance
        self.nearest: dict[str, int] = {}                  # agent -> quantised min over workflows
        self.shared: dict[int, dict[int, Node]] = {}       # agent bit -> shared nodes
        self.offloaded: dict[int, Node] = {}
        self._by_bit: list[str] = []
        self.counts: dict[str, list[int]] = {}             # agent -> workflows at each distance

    # ---------------------------------------------------------------- ranking

    def priority(self, node: Node) -> tuple:
        if node.tier != Tier.DEVICE:
            return (0, node.last_access)
        return (-self.node_distance(node), node.last_access)

    def node_distance(self, node: Node) -> int:
        """Quantised distance of the nearest call expected to reuse `node`."""
        far = self.far * QUANTUM
        names = self._names()
        if node.seen_workflows >= 2:
            return min((self.nearest.get(names[b], far) for b in bits(node.agent_mask)), default=far)
        best = far
        for w, mask in node.wf_agents.items():
            table = self.wf_dist.get(w, {})
            for b in bits(mask):
                best = min(best, self._q(table.get(names[b], self.far)))
        return best

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        if dst is not None and node.alive:
            self.offloaded[node.id] = node
        else:
            self.offloaded.pop(node.id, None)

    # ---------------------------------------------------------------- events

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self.last[workflow] = START
        self._set(workflow, self.dist.from_last(START))

    def on_call_start(self, event: CallEvent) -> None:
        w = event.workflow
        self.dist.observe(self.last.get(w, START), event.agent)
        self.last[w] = event.agent
        table = dict(self.dist.from_last(event.agent, event.step))
        table[event.agent] = 0.0  # running now
        self._register_shared(event.node)
        self._set(w, table)

    def on_call_end(self, event: CallEvent) -> None:
        self._register_shared(event.node)
        self._set(event.workflow, self.dist.from_last(event.agent, event.step))

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        self.dist.observe(self.last.pop(workflow, START), END)
        self._set(workflow, None)
        for node in nodes:
            self.cache.refresh(node)

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        wanted = []
        for node_id, node in list(self.offloaded.items()):
            if not node.alive or node.tier == Tier.DEVICE or (node.seen_workflows < 2 and not node.wf_agents):
                del self.offloaded[node_id]  # gone, back, or private to ended workflows: never wanted
                continue
            d = self.node_distance(node)
            if d <= QUANTUM and node.lock == 0:
                wanted.append((d, -node.start, node.id, node))
        return [n for *_, n in sorted(wanted)]

    # ---------------------------------------------------------------- bookkeeping

    def _q(self, distance: float) -> int:
        return min(self.far * QUANTUM, int(distance * QUANTUM))

    def _names(self) -> list[str]:
        """Agent names by tree bit (agents are numbered in order of first use, never renumbered)."""
        ids = self.cache.tree.agent_ids
        if len(self._by_bit) != len(ids):
            self._by_bit = sorted(ids, key=ids.get)
        return self._by_bit

    def _set(self, workflow: int, table: dict[str, float] | None) -> None:
        """Store a workflow's distances; re-rank its nodes and the shared nodes of agents whose
        nearest distance moved (per agent, a count of workflows at each quantised distance)."""
        old = self.wf_dist.pop(workflow, {})
        if table is not None:
            self.wf_dist[workflow] = table
        for node in self.cache.tree.workflow_nodes.get(workflow, {}).values():
            if node.alive:
                self.cache.refresh(node)
        far = self.far * QUANTUM
        new = table or {}
        for agent in dict.fromkeys([*old, *new]):
            before = self._q(old[agent]) if agent in old else None
            after = self._q(new[agent]) if agent in new else None
            if before == after:
                continue
            counts = self.counts.setdefault(agent, [0] * (far + 1))
            if before is not None:
                counts[before] -= 1
            if after is not None:
                counts[after] += 1
            best = next((d for d, c in enumerate(counts) if c), far)
            if best != self.nearest.get(agent, far):
                self.nearest[agent] = best
                self._refresh_agent(agent)

    def _register_shared(self, node: Node) -> None:
        tree = self.cache.tree
        while node is not tree.root and node.seen_workflows >= 2:
            known = node.policy_data or 0  # agent bits this node is indexed under
            if known != node.agent_mask:
                for b in bits(node.agent_mask & ~known):
                    self.shared.setdefault(b, {})[node.id] = node
                node.policy_data = node.agent_mask
            node = node.parent

    def _refresh_agent(self, agent: str) -> None:
        bit = self.cache.tree.agent_ids.get(agent)
        nodes = self.shared.get(bit)
        if nodes:
            self.refresh_live(nodes)
