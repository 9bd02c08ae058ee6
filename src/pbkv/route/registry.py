"""Routers by name. Built-ins are imported lazily; `module:Class` loads an out-of-tree router."""

from __future__ import annotations

import importlib

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


def router_names() -> list[str]:
    return list(BUILTIN)


def register(name: str, target: str) -> None:
    """Make `name` resolve to `target` ("package.module:Class")."""
    BUILTIN[name] = target


def router_class(name: str) -> type[Router]:
    target = BUILTIN.get(name, name if ":" in name else None)
    if target is None:
        raise UnknownRouter(f"unknown router {name!r}; known routers: {', '.join(BUILTIN)} "
                            f"(or 'package.module:Class')")
    module, _, cls = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise UnknownRouter(f"router {name!r}: cannot load {target!r} ({e})") from None
    if not (isinstance(found, type) and issubclass(found, Router)):
        raise UnknownRouter(f"router {name!r}: {target!r} is not a pbkv Router subclass")
    return found


def make_router(name: str, config: RouterConfig | None = None) -> Router:
    return router_class(name)(config)
