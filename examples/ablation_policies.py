"""pbkv with one rule switched off or moved: out-of-tree policies for diagnosing where pbkv's
gain comes from (docs/benchmarks.md, "Which of pbkv's rules carry the gain").

Run them beside the built-ins by `module:Class` name, with this folder on the path:

    PYTHONPATH=examples pbkv bench --trace B.jsonl --train A.jsonl --concurrency 16 \\
        --policies lru,pbkv,ablation_policies:NoDead,ablation_policies:NoStaleness,oracle

Each is a diagnostic, not a product: it changes exactly one rule of `pbkv.policy.pbkv` and keeps
the rest (predictions, timing, admission, prefetch).
"""

from __future__ import annotations

from pbkv.policy.pbkv import PBKVPolicy


class NoDead(PBKVPolicy):
    """No node is ever called predicted-dead: below the retired class, everything is ranked by
    predicted next use (a node with p = 0 still sorts last, at its far time)."""

    name = "pbkv-nodead"
    dead_p = 0.0


class NoRetired(PBKVPolicy):
    """Retired cache (private to ended workflows) is not evicted first: it ranks like any other
    node no active workflow will read."""

    name = "pbkv-noretired"

    def _retired(self, node) -> bool:
        return False


class NoStaleness(PBKVPolicy):
    """A workflow's reuse probability of a node is its agents' (no staleness cap): every node of
    an agent that a workflow will call is taken as read, old conversations included."""

    name = "pbkv-nostaleness"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.next_use.stale.live = lambda workflow, block: 1.0


class NoCommon(PBKVPolicy):
    """No node is common: a prefix shared across workflows is valued only by the active
    workflows that used it (no cross-workflow popularity)."""

    name = "pbkv-nocommon"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scores.is_common = lambda node: False


class Dead02(PBKVPolicy):
    """The dead threshold (`pbkv.DEAD_P`, 0.05) moved to 0.02."""

    name = "pbkv-dead02"
    dead_p = 0.02


class Dead10(PBKVPolicy):
    """The dead threshold moved to 0.10."""

    name = "pbkv-dead10"
    dead_p = 0.10


class Dead20(PBKVPolicy):
    """The dead threshold moved to 0.20."""

    name = "pbkv-dead20"
    dead_p = 0.20


class Dead35(PBKVPolicy):
    """The dead threshold moved to 0.35."""

    name = "pbkv-dead35"
    dead_p = 0.35
