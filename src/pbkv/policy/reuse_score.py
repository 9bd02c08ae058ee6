"""PBKV's reuse score of a cache node, from every active workflow's prediction.

    Score(c) = sum_{k=1..K} gamma^(k-1) * sum_{w in W(c)} s_w^(k) * (A_w(c) . P_w^(k))

P_w^(k) is workflow w's predicted distribution of the agent of its k-th next call, s_w^(k) the
probability that it makes that call, A_w(c) the agents whose calls used node c. For each
workflow the inner sum is precomputed per agent class, q_w[a] = sum_k gamma^(k-1) s_w^(k)
P_w^(k)[a], so a node's score is a sum over the agents in its tags.

Which workflows count, W(c):
- an ordinary node: the active workflows that used it, each with the agents it used it for
  (the paper's rule);
- a *common* node, used by at least `common_share` of all workflows seen (an agent's fixed
  prompt, a framework preamble): every active workflow, with the agents that ever used the
  node, because any running workflow about to call one of them reuses it even if it has not
  used it yet. This is cross-workflow popularity: a popular prefix outscores private cache.
A node is *retired* when it is not common and every workflow that used it has ended.

Invariant: a node never scores below any descendant. Its tags contain its descendants' tags,
it was used by at least as many workflows (so a common node's ancestors are common), and a
common node sums over a superset of workflows; a prefix is worth at least its best descendant.
The one-step value V1(c), which ranks prefetches, is the same with K=1 and no discount.
"""

from __future__ import annotations

from pbkv.cache import Node


def bits(mask: int):
    """Indices of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class ReuseScores:
    """Per-workflow agent values and their totals over active workflows; scores nodes."""

    def __init__(self, gamma: float = 0.8, horizon: int = 3, common_share: float = 0.05):
        self.gamma, self.horizon, self.common_share = gamma, horizon, common_share
        self.q: dict[int, list[float]] = {}      # workflow -> value per agent class (K steps)
        self.v1: dict[int, list[float]] = {}     # workflow -> value per agent class (next step)
        self.total_q: list[float] = []
        self.total_v1: list[float] = []
        self.classes: list[str] = []             # agent classes of the predictor, "<unk>" last
        self.workflows_seen = 0
        self._class_of_bit: list[int] = []       # tree agent bit -> class index
        self._mask_classes: dict[int, frozenset[int]] = {}   # agent mask -> classes (memo)
        self.agent_ids: dict[str, int] = {}      # the tree's agent numbering (shared object)

    def bind(self, agent_ids: dict[str, int]) -> None:
        self.agent_ids = agent_ids

    # ------------------------------------------------------------------ node classes

    def common_threshold(self) -> float:
        """Workflows that must have used a node for it to be common (a scan over many nodes
        reads it once)."""
        return max(2.0, self.common_share * self.workflows_seen)

    def is_common(self, node: Node) -> bool:
        return node.seen_workflows >= self.common_threshold()

    def is_retired(self, node: Node) -> bool:
        return node.seen_workflows > 0 and not node.wf_agents and not self.is_common(node)

    def score(self, node: Node) -> float:
        return self._value(node, self.q, self.total_q)

    def one_step(self, node: Node) -> float:
        return self._value(node, self.v1, self.total_v1)

    # ------------------------------------------------------------------ predictions

    def update(self, workflow: int, classes: list[str], probs, survival) -> list[int]:
        """Store a workflow's new prediction; return the agent classes whose totals moved."""
        if classes != self.classes:
            self._reset_classes(classes)
        q = [0.0] * len(classes)
        weight = 1.0
        for step in range(min(self.horizon, len(survival))):
            s = float(survival[step]) * weight
            row = probs[step]
            for a in range(len(classes)):
                q[a] += s * float(row[a])
            weight *= self.gamma
        v1 = [float(survival[0]) * float(p) for p in probs[0]]
        old_q, old_v1 = self.q.get(workflow), self.v1.get(workflow)
        self.q[workflow], self.v1[workflow] = q, v1
        moved = []
        for a in range(len(classes)):
            dq = q[a] - (old_q[a] if old_q else 0.0)
            self.total_q[a] += dq
            self.total_v1[a] += v1[a] - (old_v1[a] if old_v1 else 0.0)
            if abs(dq) > 0.01 * max(1.0, abs(self.total_q[a])):
                moved.append(a)
        return moved

    def remove(self, workflow: int) -> list[int]:
        """Forget an ended workflow; return the classes whose totals dropped noticeably."""
        q, v1 = self.q.pop(workflow, None), self.v1.pop(workflow, None)
        if q is None:
            return []
        for a in range(len(q)):
            self.total_q[a] -= q[a]
            self.total_v1[a] -= v1[a]
        return [a for a in range(len(q)) if q[a] > 0.01 * max(1.0, abs(self.total_q[a]))]

    def class_of(self, agent: str) -> int:
        """The predictor's class index of `agent` (unknown agents: the last class, UNK)."""
        try:
            return self.classes.index(agent)
        except ValueError:
            return len(self.classes) - 1

    def agent_bits_of(self, classes: list[int]) -> int:
        """Mask of the tree agent bits that map to any of `classes`."""
        self._extend_bits()
        wanted = set(classes)
        return sum(1 << b for b, c in enumerate(self._class_of_bit) if c in wanted)

    # ------------------------------------------------------------------ internals

    def _value(self, node: Node, per_workflow: dict[int, list[float]], totals: list[float]) -> float:
        if not self.classes:
            return 0.0
        self._extend_bits()
        if self.is_common(node):
            return sum(totals[c] for c in self._classes_in(node.agent_mask))
        score = 0.0
        for w, mask in node.wf_agents.items():
            values = per_workflow.get(w)
            if values is not None:
                score += sum(values[c] for c in self._classes_in(mask))
        return score

    def _classes_in(self, mask: int) -> frozenset[int]:
        """The agent classes of a tree agent mask (memoised: masks repeat across nodes)."""
        found = self._mask_classes.get(mask)
        if found is None:
            cob = self._class_of_bit
            found = self._mask_classes[mask] = frozenset(cob[b] for b in bits(mask))
        return found

    def _extend_bits(self) -> None:
        if len(self._class_of_bit) < len(self.agent_ids):
            self._mask_classes = {}
            index = {name: i for i, name in enumerate(self.classes)}
            unknown = len(self.classes) - 1
            by_bit = sorted(self.agent_ids.items(), key=lambda kv: kv[1])
            self._class_of_bit = [index.get(name, unknown) for name, _ in by_bit]

    def _reset_classes(self, classes: list[str]) -> None:
        """A retrained predictor may know other agents: re-index stored values by name."""
        index = {name: i for i, name in enumerate(self.classes)}

        def remap(values: list[float]) -> list[float]:
            return [values[index[c]] if c in index else 0.0 for c in classes]

        self.q = {w: remap(v) for w, v in self.q.items()}
        self.v1 = {w: remap(v) for w, v in self.v1.items()}
        self.classes = list(classes)
        self.total_q = [sum(v[a] for v in self.q.values()) for a in range(len(classes))]
        self.total_v1 = [sum(v[a] for v in self.v1.values()) for a in range(len(classes))]
        self._class_of_bit = []
        self._mask_classes = {}
