"""A predictor with its answers computed ahead in batches (trace replay only).

Replaying a trace, every (history, context) the policy will ask about is known before the run,
so one batched forward pass answers them all far faster than one pass per call. Answers are
exactly the wrapped predictor's (same model, same inputs); anything not precomputed falls
through to it. Not for online learning, where the model changes during the run.
"""

from __future__ import annotations

from pbkv.trace import Call


class CachedPredictor:
    def __init__(self, predictor, workflows: list[list[Call]], batch: int = 2048):
        self.inner = predictor
        self.name, self.horizon, self.agents = predictor.name, predictor.horizon, predictor.agents
        items, keys = [], []
        for calls in workflows:
            history: list[str] = []
            for call in calls:
                history.append(call.agent)
                items.append((list(history), call.context))
                keys.append((tuple(history), call.context))
        self.table = {}
        for i in range(0, len(items), batch):
            for key, pred in zip(keys[i:i + batch], predictor.predict_batch(items[i:i + batch])):
                self.table[key] = pred

    def predict(self, history: list[str], context: str | None = None, hidden=None):
        found = self.table.get((tuple(history), context)) if hidden is None else None
        return found if found is not None else self.inner.predict(history, context, hidden)

    def predict_batch(self, items):
        return [self.predict(h, c) for h, c in items]
