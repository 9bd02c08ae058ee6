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
    an agent that a workflow will call is taken as read, old conversations included.

    Staleness reaches pbkv two ways, and both are switched off: the eviction ranking reads it
    through `NextUse._read` (each predicted call's chance scaled by the block's state, from
    `Staleness.state` / `.table`), prefetch through `Staleness.live`. (Before 2026-12-03 only
    `live` was patched, so this ranked exactly like pbkv.) Staleness still learns its tables;
    nothing reads them."""

    name = "pbkv-nostaleness"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.next_use._read = lambda workflow, block, mask: None       # the ranking: agent-level only
        self.next_use.stale.live = lambda workflow, block: 1.0        # prefetch


class NoCommon(PBKVPolicy):
    """No node is common: a prefix shared across workflows is valued only by the active
    workflows that used it (no cross-workflow popularity)."""

    name = "pbkv-nocommon"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scores.is_common = lambda node: False


def dead_at(threshold: float) -> type[PBKVPolicy]:
    """pbkv with the dead threshold (`pbkv.DEAD_P`, 0.05) moved to `threshold`."""
    tag = f"{round(threshold * 100):02d}"
    doc = f"The dead threshold moved to {threshold:g}."
    return type(f"Dead{tag}", (PBKVPolicy,), {"name": f"pbkv-dead{tag}", "dead_p": threshold, "__doc__": doc})


Dead02, Dead10, Dead20, Dead35 = (dead_at(t) for t in (0.02, 0.10, 0.20, 0.35))
