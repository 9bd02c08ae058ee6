"""`pbkv-perfect`: pbkv's score and order fed the replayed trace's true next agents.

A diagnostic bound, like the oracle: it shows how much of pbkv's gap to the oracle better
predictions could close (the rest lies in the score itself). It reads the future, so it needs
no trained predictor. Each call is looked up by its workflow id and step
(`PerfectPredictor.for_workflow`): an agent history and context name several workflows of a
generated workload, and looking calls up by them (until 2026-12-02) fed it other workflows'
futures."""

from __future__ import annotations

from dataclasses import replace

from pbkv.policy.base import PolicyContext
from pbkv.policy.pbkv import PBKVPolicy
from pbkv.predict.perfect import PerfectPredictor


class PBKVPerfectPolicy(PBKVPolicy):
    name = "pbkv-perfect"
    variant = "perfect"
    reads_future = True

    def __init__(self, ctx: PolicyContext):
        if ctx.future is None:
            raise ValueError("pbkv-perfect reads the replayed trace: it needs the trace's future")
        horizon = int(ctx.horizon or 3)
        perfect = PerfectPredictor(ctx.future.workflows, horizon)
        super().__init__(replace(ctx, predictors={**ctx.predictors, "perfect": perfect}))
        self.ids: dict[int, str] = {}

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self.ids[workflow] = workflow_id
        super().on_workflow_start(workflow, workflow_id)

    def on_workflow_end(self, workflow: int, nodes) -> None:
        super().on_workflow_end(workflow, nodes)
        self.ids.pop(workflow, None)

    def _prediction(self, w: int, hidden):
        return self.predictor.for_workflow(self.ids[w], len(self.history[w]) - 1)
