"""What to keep: eviction/prefetch policies behind one interface, chosen by name."""

from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest
from pbkv.policy.registry import UnknownPolicy, make_policy, needs_future, policy_names, register

__all__ = ["Policy", "PolicyContext", "CallEvent", "PrefetchRequest", "make_policy", "policy_names",
           "needs_future", "register", "UnknownPolicy"]
