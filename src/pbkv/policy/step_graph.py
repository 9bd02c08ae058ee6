"""KVFlow's Agent Step Graph: steps-to-execution of every agent from where a workflow stands.

Our workflows make one call per step, so every join is an OR-branch and steps-to-execution is
KVFlow's `min(preds) + 1` rule: the length of the shortest path in the agent graph from the
agent that ran last (steps 1 for its possible successors). The running agent has 0 steps;
agents beyond `horizon` or unreachable get `horizon`, the "far" bucket of KVFlow's hold levels.

For a static workflow (every run calls the same agents in the same order) KVFlow's graph is
the invocation chain itself, so steps are exact positions: `StepGraph(sequence=...)`.
"""

from __future__ import annotations

from collections import deque

START = "START"
END = "END"


class StepGraph:
    """Shortest step distances between agents of a static workflow graph."""

    def __init__(self, edges: dict[str, list[str]], horizon: int = 5, sequence: list[str] | None = None):
        self.horizon = horizon
        self.edges = {a: [b for b in nxt if b != END] for a, nxt in edges.items()}
        self.sequence = sequence
        self._dist: dict[object, dict[str, int]] = {}

    def steps_from(self, last: str, step: int = -1) -> dict[str, int]:
        """Agent -> steps until it can next run, given that `last` ran last as call `step`
        (START and -1 before the first call)."""
        key = step if self.sequence else last
        found = self._dist.get(key)
        if found is None:
            found = self._dist[key] = self._positions(step) if self.sequence else self._bfs(last)
        return found

    def _positions(self, step: int) -> dict[str, int]:
        dist: dict[str, int] = {}
        for j in range(step + 1, min(len(self.sequence), step + self.horizon)):
            dist.setdefault(self.sequence[j], j - step)
        return dist

    def _bfs(self, source: str) -> dict[str, int]:
        dist: dict[str, int] = {}
        queue = deque([(source, 0)])
        while queue:
            agent, d = queue.popleft()
            for nxt in self.edges.get(agent, ()):
                if nxt not in dist and d + 1 < self.horizon:
                    dist[nxt] = d + 1
                    queue.append((nxt, d + 1))
        return dist

    def steps(self, last: str, agent: str, step: int = -1) -> int:
        return self.steps_from(last, step).get(agent, self.horizon)


def graph_from_sequences(sequences: list[list[str]]) -> dict[str, list[str]]:
    """The agent graph a developer would draw from observed runs (START/END included)."""
    edges: dict[str, dict[str, None]] = {}
    for seq in sequences:
        prev = START
        for agent in seq + [END]:
            edges.setdefault(prev, {})[agent] = None
            prev = agent
    return {a: list(nxt) for a, nxt in edges.items()}


def static_sequence(sequences: list[list[str]]) -> list[str] | None:
    """The common agent sequence when every run is identical (a static workflow), else None."""
    first = sequences[0] if sequences else None
    return first if first and all(seq == first for seq in sequences) else None
