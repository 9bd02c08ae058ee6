"""What pbkv may load back ahead of use, and into which space.

Two kinds of load, the certain ones first:
- *queued* prefixes: a call that arrived and waits for admission will read its prompt's cached
  prefix; where that prefix lies below the device, it is loaded while the link is idle, in
  arrival order (the engine admits first come, first served). Room for it may be made only by
  evicting nodes pbkv ranks below a read at that call's arrival (`PBKVPolicy.prefetch_floor`,
  enforced by the cache): the nodes its admission would evict first, only earlier, so the call
  does not wait on the link when admitted. Measured on 36 real-trace cells (docs/benchmarks.md,
  "Queued calls' prefixes are loaded ahead"): BFCL with a small device and a host holding the
  rest, where every call loads a ~6k-token system prompt, gains most (1.018x -> 1.084x LRU).
- *speculative* loads: nodes evicted below the device (`offloaded`) that an active workflow
  tagged or that are common, valued by `value`: the one-step reuse value (`reuse_score.py`)
  times, for a private node, its staleness (`staleness.py`: the next call may be its agent's yet
  not read this cache). Space: free device tokens plus retired device nodes (`retired`,
  `retired_space.py`: cache private to workflows that all ended), so a prediction never
  displaces cache an active workflow may use; the choice within that space and the link's
  budget is `conservative_prefetch.plan`.

Invariant: `plan` counts only nodes that qualify when it runs: a node in `retired` was a retired
device node when added and one in `offloaded` was evicted below the device; each is re-checked
when a scan meets it (dropped, loaded back, locked or no longer retired nodes are removed then;
`retired` re-checks only the nodes an event may have changed since its last reading).
An offloaded node the scan finds untagged and not common is parked in `dormant` (most offloaded
nodes are retired cache, and the scan runs at every decode-only batch): untagged, its
`seen_workflows` cannot grow and the common threshold never falls, so it cannot qualify until a
workflow tags it. A tag adds it to the tree's `workflow_nodes[w]`, which only grows while w
lives: each scan first wakes (moves back to `offloaded`) the dormant nodes among the entries
added since the last scan, and a workflow's end wakes those it tagged (`ended`). Eviction wakes
a node too. So the candidates are exactly those a scan of every offloaded node would find.
A queued prefix is held from its call's arrival to its end, and offered only while it is alive,
unlocked and not on the device.
"""

from __future__ import annotations


from pbkv.cache import Node, Tier
from pbkv.policy import conservative_prefetch
from pbkv.policy.base import PrefetchRequest
from pbkv.policy.new_tags import new_tags
from pbkv.policy.retired_space import RetiredSpace
from pbkv.policy.reuse_score import ReuseScores
from pbkv.policy.staleness import Staleness


class PrefetchCandidates:
    def __init__(self, scores: ReuseScores, stale: Staleness, version: dict[int, int]):
        self.scores, self.stale = scores, stale
        self.version = version                   # workflow -> count of its predictions (memo stamp)
        self.retired = RetiredSpace(scores)      # device nodes that retired (prefetch space)
        self.offloaded: dict[int, Node] = {}     # nodes evicted below the device
        self.dormant: dict[int, Node] = {}       # offloaded nodes found untagged and not common
        self.swept = 0                           # len(dormant) after its last sweep
        self.tags: dict[int, dict[int, Node]] = {}  # the tree's workflow -> nodes it tagged (`bind`)
        self.marks: dict[int, tuple[dict, int]] = {}  # workflow -> (its `tags` entry, entries seen)
        self.queued: dict[int, tuple[float, Node]] = {}  # workflow -> (arrival, its prompt's cached node then)
        self.on_node: dict[int, dict[int, float]] = {}   # node id -> {workflow: arrival}: `queued` by node

    def bind(self, tree) -> None:
        """Read the tags of `tree` (the cache's radix tree): new tags wake dormant nodes."""
        self.tags = tree.workflow_nodes
        self.retired.bind(tree)

    def arrived(self, workflow: int, now: float, node: Node) -> None:
        """A call of `workflow` arrived; `node` is the deepest cached node of its prompt (the
        root when none is cached)."""
        self.served(workflow)
        self.queued[workflow] = (now, node)
        self.on_node.setdefault(node.id, {})[workflow] = now

    def served(self, workflow: int) -> None:
        entry = self.queued.pop(workflow, None)
        if entry is not None:
            waiting = self.on_node[entry[1].id]
            del waiting[workflow]
            if not waiting:
                del self.on_node[entry[1].id]

    def waiting(self) -> list[Node]:
        """Queued prefixes below the device, earliest arrival first (a call with nothing cached
        holds the root, which is on the device and locked: never offered)."""
        device = Tier.DEVICE
        below = [(at, w, node) for w, (at, node) in self.queued.items()  # filtered before sorting:
                 if node.alive and node.tier != device and node.lock == 0]  # most are on the device
        chosen, seen = [], set()
        for _, _, node in sorted(below, key=lambda item: (item[0], item[1])):
            if node.id not in seen:
                seen.add(node.id)
                chosen.append(node)
        return chosen

    def arrival_on(self, node: Node) -> float | None:
        """The earliest arrival of a waiting call whose prompt's cached path ends at `node`."""
        waiting = self.on_node.get(node.id)  # an index, not a scan of `queued`: asked per ranked node
        return min(waiting.values()) if waiting else None

    def evicted(self, node: Node, dst: Tier | None) -> None:
        self.retired.drop(node)
        if dst is not None and node.alive:
            self.dormant.pop(node.id, None)
            self.offloaded[node.id] = node

    def ended(self, workflow: int, nodes: list[Node]) -> None:
        """`workflow` ended; `nodes`: the live nodes it tagged. A dormant one may be common now
        (its tag counted it in `seen_workflows`, and the tree no longer lists it under the
        workflow for `_wake` to find)."""
        self.marks.pop(workflow, None)
        self.retired.ended(workflow, nodes)
        dormant = self.dormant
        if dormant:
            for node in nodes:
                if node.id in dormant:
                    self.offloaded[node.id] = dormant.pop(node.id)

    def retire(self, node: Node) -> None:
        """`node`, on the device, is now private to ended workflows only."""
        self.retired.add(node)

    def plan(self, request: PrefetchRequest) -> list[Node]:
        """Nodes to load now: queued prefixes (`waiting`), then speculative loads, best value
        first, within free + retired space and the budget."""
        queued = self.waiting()
        ids = {n.id for n in queued}
        return queued + [n for n in self._speculative(request) if n.id not in ids]

    def _speculative(self, request: PrefetchRequest) -> list[Node]:
        space = request.free_tokens + self.retired_device_tokens()
        if space <= 0:
            return []
        candidates = [(self.value(node), node) for node in self.candidates()]
        if not candidates:
            return []
        return conservative_prefetch.plan(candidates, request.budget_tokens, space)

    def candidates(self) -> list[Node]:
        """The offloaded nodes that qualify now: alive, below the device, tagged or common (in
        no particular order: `conservative_prefetch.plan` orders them by value, then node)."""
        self._wake()
        chosen, gone, parked, common = [], [], [], self.scores.common_threshold()
        device = Tier.DEVICE
        for node_id, node in self.offloaded.items():
            if not node.alive or node.tier == device:
                gone.append(node_id)
            elif node.wf_agents or node.seen_workflows >= common:  # tagged, or `is_common`
                chosen.append(node)
            else:
                parked.append(node_id)
        for node_id in gone:
            del self.offloaded[node_id]
        self._park(parked)
        return chosen

    def _wake(self) -> None:
        """Move back to `offloaded` the dormant nodes tagged since the last scan: the entries
        each live workflow's `tags` gained since then (a workflow id used again gets a new
        dict, seen from its start)."""
        dormant = self.dormant
        for fresh in new_tags(self.tags, self.marks):
            if dormant:
                for node_id in fresh:
                    if node_id in dormant:
                        self.offloaded[node_id] = dormant.pop(node_id)

    def _park(self, node_ids: list[int]) -> None:
        """Move untagged, uncommon offloaded nodes to `dormant`; sweep out the dropped and the
        loaded back once it has doubled (they never qualify again unless evicted: `evicted`)."""
        offloaded, dormant = self.offloaded, self.dormant
        for node_id in node_ids:
            dormant[node_id] = offloaded.pop(node_id)
        if len(dormant) > 2 * self.swept + 1024:
            device = Tier.DEVICE
            self.dormant = {i: n for i, n in dormant.items() if n.alive and n.tier != device}
            self.swept = len(self.dormant)

    def value(self, node: Node) -> float:
        """`scores.one_step` of a node, times its staleness for nodes that are not common;
        memoised on a private node until its workflow's next prediction (the scan runs at every
        decode-only batch: policy time)."""
        if self.scores.is_common(node):
            return self.scores.one_step(node)
        if len(node.wf_agents) != 1:
            live = max((self.stale.live(w, node.blocks[0]) for w in node.wf_agents), default=1.0)
            return self.scores.one_step(node) * live
        (w, mask), = node.wf_agents.items()
        stamp = (w, mask, self.version.get(w))
        memo = node.policy_data
        if memo is None or memo[0] != stamp:
            value = self.scores.one_step(node) * self.stale.live(w, node.blocks[0])
            memo = node.policy_data = (stamp, value)
        return memo[1]

    def retired_device_tokens(self) -> int:
        """Device tokens of the retired nodes that still qualify (`RetiredSpace.tokens`)."""
        return self.retired.tokens()
