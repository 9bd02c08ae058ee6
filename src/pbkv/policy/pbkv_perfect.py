"""`pbkv-perfect`: pbkv's score and order fed the replayed trace's true next agents.

A diagnostic bound, like the oracle: it shows how much of pbkv's gap to the oracle better
predictions could close (the rest lies in the score itself). It reads the future, so it needs
no trained predictor."""

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
