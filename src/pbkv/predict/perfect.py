"""A predictor that knows the replayed trace: the true next K agents, one-hot, and the true end.

For diagnosis only (the `pbkv-perfect` policy): it bounds what better predictions could give
pbkv's score. `for_workflow(workflow_id, step)` is exact. `predict(history, context)` (the
predictor protocol) can only look a call up by its agent history and context, which several
workflows of a generated workload share (hover draws its context from a few phrases): such a
key answers with the first of those workflows' futures. Until 2026-12-02 `pbkv-perfect` used
`predict`, so at many calls it was fed another workflow's future (issue 11). A position it was
not built for gets a uniform guess with survival 0.5."""

from __future__ import annotations

import numpy as np

from pbkv.predict.base import UNK, Prediction
from pbkv.trace import Call


class PerfectPredictor:
    name = "perfect"

    def __init__(self, workflows: list[list[Call]], horizon: int = 3):
        self.horizon = horizon
        self.agents = sorted({c.agent for calls in workflows for c in calls})
        index = {a: i for i, a in enumerate(self.agents)}
        classes = self.agents + [UNK]
        self.by_call: dict[tuple[str, int], Prediction] = {}   # (workflow id, step) -> its future
        self.table: dict[tuple, Prediction] = {}               # (agent history, context) -> first such future
        for calls in workflows:
            for s in range(len(calls)):
                probs = np.zeros((horizon, len(classes)))
                survival = np.zeros(horizon)
                for k in range(1, horizon + 1):
                    if s + k < len(calls):
                        probs[k - 1, index[calls[s + k].agent]] = 1.0
                        survival[k - 1] = 1.0
                    else:
                        probs[k - 1, -1] = 1.0  # no call: any row that sums to 1 will do
                pred = Prediction(classes, probs, survival)
                self.by_call[(calls[s].workflow_id, s)] = pred
                self.table.setdefault((tuple(c.agent for c in calls[:s + 1]), calls[s].context), pred)
        self._unknown = Prediction(classes, np.full((horizon, len(classes)), 1.0 / len(classes)),
                                   np.full(horizon, 0.5))

    def for_workflow(self, workflow_id: str, step: int) -> Prediction:
        """The true future after call `step` (0-based) of workflow `workflow_id`."""
        return self.by_call.get((workflow_id, step), self._unknown)

    def predict(self, history: list[str], context: str | None = None, hidden=None) -> Prediction:
        return self.table.get((tuple(history), context), self._unknown)

    def predict_batch(self, items):
        return [self.predict(h, c) for h, c in items]
