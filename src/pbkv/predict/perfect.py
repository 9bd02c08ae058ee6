"""A predictor that knows the replayed trace: the true next K agents, one-hot, and the true end.

For diagnosis only (the `pbkv-perfect` policy): it bounds what better predictions could give
pbkv's score. A position it was not built for gets a uniform guess with survival 0.5."""

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
        self.table: dict[tuple, Prediction] = {}
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
                key = (tuple(c.agent for c in calls[:s + 1]), calls[s].context)
                self.table[key] = Prediction(classes, probs, survival)
        self._unknown = Prediction(classes, np.full((horizon, len(classes)), 1.0 / len(classes)),
                                   np.full(horizon, 0.5))

    def predict(self, history: list[str], context: str | None = None, hidden=None) -> Prediction:
        return self.table.get((tuple(history), context), self._unknown)

    def predict_batch(self, items):
        return [self.predict(h, c) for h, c in items]
