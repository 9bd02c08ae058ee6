"""ScaleSim's invocation distance: expected steps until each agent is next invoked.

From the agent that ran last, the workflow is modelled as a Markov chain over agents learned
from the transitions observed so far (seeded with one count per edge of the developer's agent
graph, so it is usable before anything was observed). For each agent b the distance is
E[min(T_b, H)], T_b the number of calls until b is called (1 = next call), H the horizon: an
agent that is never reached (the workflow ends first) counts H. For a static workflow (the same
agent sequence every run) the distance is exact: the position of b's next call.

Tables are cached per last agent and rebuilt after `REBUILD_EVERY` new observations.
"""

from __future__ import annotations

from pbkv.policy.step_graph import END, START, StepGraph

REBUILD_EVERY = 32


class InvocationDistance:
    def __init__(self, graph: dict[str, list[str]], horizon: int = 5, sequence: list[str] | None = None):
        self.horizon = horizon
        self.static = StepGraph({}, horizon=horizon, sequence=sequence) if sequence else None
        self.counts: dict[str, dict[str, float]] = {}
        for a, nxt in graph.items():
            for b in nxt:
                self.counts.setdefault(a, {})[b] = 1.0
        self._tables: dict[str, dict[str, float]] = {}
        self._new = 0

    def observe(self, last: str, nxt: str) -> None:
        """The workflow whose last call was `last` called `nxt` (or END)."""
        row = self.counts.setdefault(last, {})
        row[nxt] = row.get(nxt, 0.0) + 1.0
        self._new += 1
        if self._new >= REBUILD_EVERY:
            self._tables.clear()
            self._new = 0

    def from_last(self, last: str, step: int = -1) -> dict[str, float]:
        """Agent -> expected steps until it is next called, after `last` ran as call `step`
        (START, -1 before the first call). Agents not in the result are `horizon` away."""
        if self.static is not None:
            return {a: float(d) for a, d in self.static.steps_from(last, step).items()}
        table = self._tables.get(last)
        if table is None:
            table = self._tables[last] = self._build(last)
        return table

    def _build(self, source: str) -> dict[str, float]:
        agents = [a for a in dict.fromkeys([*self.counts, *(b for r in self.counts.values() for b in r)])
                  if a not in (START, END)]
        probs = {a: {b: c / sum(row.values()) for b, c in row.items()} for a, row in self.counts.items() if row}
        out = {}
        for target in agents:
            mass = {source: 1.0}       # walkers that have not called `target` yet
            expected = 0.0
            for _ in range(self.horizon):
                expected += sum(mass.values())   # P(T > k)
                nxt: dict[str, float] = {}
                for a, m in mass.items():
                    row = probs.get(a)
                    if row is None:  # END (or an agent never seen leaving): absorbed, never calls
                        nxt[a] = nxt.get(a, 0.0) + m
                        continue
                    for b, p in row.items():
                        if b != target:
                            nxt[b] = nxt.get(b, 0.0) + m * p
                mass = nxt
            if expected < self.horizon - 1e-9:
                out[target] = expected
        return out
