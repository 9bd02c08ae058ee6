"""Device tokens of retired nodes, kept incrementally: pbkv's speculative prefetch space.

A *member* is a node added by `add` (a device node private to ended workflows only). Reading
`tokens()` returns the tokens of the members that qualify now, alive, on the device, unlocked,
used (`seen_workflows > 0`), untagged and not common (`ReuseScores.is_retired`, inlined), and
drops for good the members that do not (one that would qualify again later stays out: members
come back only through `add`). Eviction drops a member at once (`drop`).

The plain rule scans every member at each reading, and a reading is taken at every decode-only
batch (policy time). Here a reading checks only *suspects*: members whose qualification or size
may have changed since the last reading. Invariant, after every reading and kept between
readings by the events below: each member not in `suspects` qualified at the last reading and
is counted in `total` by `counted[id]`, its size then. What can change a member:
- a lock taken (the tree's lock hook: `lock` 0 -> 1);
- a tag: a workflow's `touch` adds the node to the tree's `workflow_nodes[w]` (found by
  `policy.new_tags`, as `PrefetchCandidates._wake` finds them) or, when w ended before the
  reading, is among the nodes w's end hands over (`ended`); a tag is the only way
  `seen_workflows` grows;
- a split: the member keeps its deeper blocks and shrinks (the tree's split hook);
- removal from the tree (the tree's remove hook: a dropped subtree's nodes are not evicted
  one by one) or eviction off the device (`drop`, the only way a device node changes tier).
The common threshold only rises (`workflows_seen` only grows), so it never fails a member that
passed. Until `bind` gives it a tree to watch, every reading scans all members (the plain rule).
"""

from __future__ import annotations

from pbkv.cache import Node, Tier
from pbkv.policy.new_tags import new_tags
from pbkv.policy.reuse_score import ReuseScores


class RetiredSpace:
    """Retired device nodes and their tokens (see the module docstring for the invariant)."""

    def __init__(self, scores: ReuseScores):
        self.scores = scores
        self.members: dict[int, Node] = {}      # node id -> node (added, not yet dropped)
        self.counted: dict[int, int] = {}       # member id -> tokens counted in `total`
        self.total = 0                          # sum of `counted`
        self.suspects: dict[int, Node] = {}     # members to check at the next reading
        self.tags: dict[int, dict[int, Node]] | None = None  # the tree's workflow -> tagged nodes
        self.marks: dict[int, tuple[dict, int]] = {}  # workflow -> (its `tags` entry, entries seen)

    def bind(self, tree) -> None:
        """Watch `tree`'s locks, splits and removals (chained after the hooks already set: the
        cache's counters come first) and its tags."""
        self.tags = tree.workflow_nodes
        on_lock, on_split, on_remove = tree.on_lock_change, tree.on_split, tree.on_remove

        def lock_changed(node: Node, delta: int) -> None:
            on_lock(node, delta)
            if delta > 0:
                self._suspect(node)

        def split(upper: Node) -> None:
            on_split(upper)
            for lower in upper.children.values():   # just split: the node it was cut from
                self._suspect(lower)

        def removed(node: Node) -> None:
            on_remove(node)
            self._suspect(node)

        tree.on_lock_change, tree.on_split, tree.on_remove = lock_changed, split, removed

    def add(self, node: Node) -> None:
        """`node`, on the device, is now private to ended workflows only."""
        self.members[node.id] = node
        self.suspects[node.id] = node

    def drop(self, node: Node) -> None:
        """`node` left its tier (evicted, or dropped): no longer a member."""
        if self.members.pop(node.id, None) is not None:
            self.suspects.pop(node.id, None)
            self.total -= self.counted.pop(node.id, 0)

    def ended(self, workflow: int, nodes: list[Node]) -> None:
        """`workflow` ended; `nodes`: the live nodes it tagged (a tag since the last reading
        that `marks` will no longer see: the tree dropped the workflow's entry)."""
        self.marks.pop(workflow, None)
        members = self.members
        for node in nodes:
            if node.id in members:
                self.suspects[node.id] = node

    def tokens(self) -> int:
        """Tokens of the members that qualify now; the others are dropped."""
        if self.tags is None:
            self.suspects = {}
            return self._scan(dict(self.members))
        self._find_tagged()
        if self.suspects:
            self._check(self.suspects)
            self.suspects = {}
        return self.total

    def _suspect(self, node: Node) -> None:
        if node.id in self.members:
            self.suspects[node.id] = node

    def _find_tagged(self) -> None:
        """Mark the members among the entries each live workflow's `tags` gained since the last
        reading (a workflow id used again gets a new dict, seen from its start)."""
        members = self.members
        for fresh in new_tags(self.tags, self.marks):
            for node_id in fresh:
                if node_id in members:
                    self.suspects[node_id] = members[node_id]

    def _check(self, nodes: dict[int, Node]) -> None:
        """Re-count `nodes` (members): those that qualify at their size now, the rest dropped."""
        common = self.scores.common_threshold()
        device = Tier.DEVICE                     # a local: an enum member lookup per node costs more than the test
        counted, members = self.counted, self.members
        for node_id, node in nodes.items():
            self.total -= counted.pop(node_id, 0)
            if (node.alive and node.tier == device and node.lock == 0 and node.seen_workflows > 0
                    and not node.wf_agents and node.seen_workflows < common):
                counted[node_id] = node.tokens
                self.total += node.tokens
            else:
                del members[node_id]

    def _scan(self, nodes: dict[int, Node]) -> int:
        """The plain rule: check every member."""
        self.total, self.counted = 0, {}
        self._check(nodes)
        return self.total
