"""Ablations of pbkv, one switch each (`pbkv ablate` runs them side by side)."""

from __future__ import annotations

from pbkv.policy.pbkv import PBKVPolicy


class PBKVRetiredPolicy(PBKVPolicy):
    """Ablation: the lifecycle guardrail alone (retired first, then LRU); no predictor."""

    name = "pbkv-retired"
    use_scores = False
    use_prefetch = False


class PBKVNoPrefetchPolicy(PBKVPolicy):
    name = "pbkv-noprefetch"
    use_prefetch = False


class PBKVHistoryPolicy(PBKVPolicy):
    name = "pbkv-history"
    variant = "history"


class PBKVContextPolicy(PBKVPolicy):
    name = "pbkv-context"
    variant = "context"
