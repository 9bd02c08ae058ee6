"""Routers by name. Built-ins are imported lazily; `module:Class` loads an out-of-tree router."""

from __future__ import annotations

from pbkv.registry import LazyRegistry
from pbkv.route.base import Router, RouterConfig

BUILTIN: dict[str, str] = {
    "round-robin": "pbkv.route.round_robin:RoundRobinRouter",
    "least-load": "pbkv.route.least_load:LeastLoadRouter",
    "prefix": "pbkv.route.prefix:PrefixRouter",
    "sticky": "pbkv.route.sticky:StickyRouter",
    "pbkv": "pbkv.route.pbkv:PBKVRouter",
}


class UnknownRouter(ValueError):
    pass


REGISTRY = LazyRegistry("router", "routers", Router, BUILTIN, UnknownRouter)
router_names = REGISTRY.names
register = REGISTRY.register
router_class = REGISTRY.get


def make_router(name: str, config: RouterConfig | None = None) -> Router:
    return router_class(name)(config)
