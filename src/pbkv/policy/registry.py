"""Policies by name. Built-ins are imported lazily; `module:Class` loads an out-of-tree policy."""

from __future__ import annotations

import importlib

from pbkv.policy.base import Policy, PolicyContext

BUILTIN: dict[str, str] = {
    "lru": "pbkv.policy.lru:LRUPolicy",
    "kvflow": "pbkv.policy.kvflow:KVFlowPolicy",
    "oracle": "pbkv.policy.oracle:OraclePolicy",
    "pbkv": "pbkv.policy.pbkv:PBKVPolicy",
    "pbkv-retired": "pbkv.policy.pbkv:PBKVRetiredPolicy",
    "pbkv-noprefetch": "pbkv.policy.pbkv:PBKVNoPrefetchPolicy",
    "pbkv-history": "pbkv.policy.pbkv:PBKVHistoryPolicy",
    "pbkv-context": "pbkv.policy.pbkv:PBKVContextPolicy",
    "pbkv-perfect": "pbkv.policy.pbkv_perfect:PBKVPerfectPolicy",
    "continuum": "pbkv.policy.continuum:ContinuumPolicy",
    "scalesim": "pbkv.policy.scalesim:ScaleSimPolicy",
    "arc": "pbkv.policy.arc:ARCPolicy",
    "slru": "pbkv.policy.slru:SLRUPolicy",
}


class UnknownPolicy(ValueError):
    pass


def policy_names() -> list[str]:
    return list(BUILTIN)


def register(name: str, target: str) -> None:
    """Make `name` resolve to `target` ("package.module:Class")."""
    BUILTIN[name] = target


def policy_class(name: str) -> type[Policy]:
    target = BUILTIN.get(name, name if ":" in name else None)
    if target is None:
        raise UnknownPolicy(f"unknown policy {name!r}; known policies: {', '.join(BUILTIN)} "
                            f"(or 'package.module:Class')")
    module, _, cls = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise UnknownPolicy(f"policy {name!r}: cannot load {target!r} ({e})") from None
    if not (isinstance(found, type) and issubclass(found, Policy)):
        raise UnknownPolicy(f"policy {name!r}: {target!r} is not a pbkv Policy subclass")
    return found


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
