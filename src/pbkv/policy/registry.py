"""Policies by name. Built-ins are imported lazily; `module:Class` loads an out-of-tree policy."""

from __future__ import annotations

from pbkv.policy.base import Policy, PolicyContext
from pbkv.registry import LazyRegistry

BUILTIN: dict[str, str] = {
    "lru": "pbkv.policy.lru:LRUPolicy",
    "kvflow": "pbkv.policy.kvflow:KVFlowPolicy",
    "oracle": "pbkv.policy.oracle:OraclePolicy",
    "pbkv": "pbkv.policy.pbkv:PBKVPolicy",
    "pbkv-retired": "pbkv.policy.pbkv_variants:PBKVRetiredPolicy",
    "pbkv-noprefetch": "pbkv.policy.pbkv_variants:PBKVNoPrefetchPolicy",
    "pbkv-history": "pbkv.policy.pbkv_variants:PBKVHistoryPolicy",
    "pbkv-context": "pbkv.policy.pbkv_variants:PBKVContextPolicy",
    "pbkv-perfect": "pbkv.policy.pbkv_perfect:PBKVPerfectPolicy",
    "continuum": "pbkv.policy.continuum:ContinuumPolicy",
    "scalesim": "pbkv.policy.scalesim:ScaleSimPolicy",
    "arc": "pbkv.policy.arc:ARCPolicy",
    "slru": "pbkv.policy.slru:SLRUPolicy",
}


class UnknownPolicy(ValueError):
    pass


REGISTRY = LazyRegistry("policy", "policies", Policy, BUILTIN, UnknownPolicy)
policy_names = REGISTRY.names
register = REGISTRY.register
policy_class = REGISTRY.get


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    return policy_class(name)(ctx)


def needs_future(name: str) -> bool:
    """True for policies that read the replayed trace's future (the oracle)."""
    return getattr(policy_class(name), "reads_future", False)


def needed_predictor(name: str) -> str | None:
    """The trained predictor variant a policy needs ("fused", "history", "context"), or None
    (a policy reading the trace's future brings its own)."""
    cls = policy_class(name)
    if getattr(cls, "reads_future", False):
        return None
    uses = getattr(cls, "use_scores", False) or getattr(cls, "use_prefetch", False)
    return getattr(cls, "variant", None) if uses else None


def predicting_policies() -> list[str]:
    """The built-in policies that read a trained predictor, for messages refusing one elsewhere."""
    return [name for name in BUILTIN if needed_predictor(name)]
