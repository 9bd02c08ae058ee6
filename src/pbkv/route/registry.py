"""Routers by name. Built-ins are imported lazily; `module:Class` loads an out-of-tree router.

Invariant: `router_class(name)` returns a concrete `Router` subclass that `cls(config)` builds,
or raises `UnknownRouter` (a ValueError: the CLI reports it as a usage error) naming the router
and why: an unknown name, an odd `package.module:Class` spelling, a class that cannot load, is
not a Router, is abstract or needs more than a config to build.
"""

from __future__ import annotations

import inspect

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


def router_class(name: str) -> type[Router]:
    """The class `name` resolves to (see the module's invariant)."""
    if not isinstance(name, str):
        raise UnknownRouter(f"router name must be a string, got {name!r}")
    _check_spelling(name, REGISTRY.builtin.get(name, name))
    cls = REGISTRY.get(name)
    _check_buildable(name, cls)
    return cls


def _check_spelling(name: str, target: str) -> None:
    """A `module:Class` target must be dotted identifiers, one colon, an identifier: anything
    else ('.foo:Bar', ':', 'a:b:c') would reach importlib, which answers with TypeError or a
    message that names neither the router nor the expected form."""
    if ":" not in target:
        return   # not a class path: the registry reports the unknown name
    module, _, cls = target.partition(":")
    if not (cls.isidentifier() and all(part.isidentifier() for part in module.split("."))):
        raise UnknownRouter(f"router {name!r}: {target!r} is not 'package.module:Class' "
                            f"(dotted module names and a class name, absolute)")


def _check_buildable(name: str, cls: type[Router]) -> None:
    """Refuse now what `cls(config)` would refuse at the first run: abstract methods left
    unimplemented, or a constructor that needs more than the config."""
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UnknownRouter(f"router {name!r}: {cls.__module__}:{cls.__qualname__} is abstract "
                            f"(does not implement {missing})")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return   # no signature to read (a C-level constructor): building it will tell
    try:
        signature.bind(RouterConfig())
    except TypeError as e:
        raise UnknownRouter(f"router {name!r}: {cls.__module__}:{cls.__qualname__}{signature} cannot be "
                            f"built from a RouterConfig alone ({e})") from None


def make_router(name: str, config: RouterConfig | None = None) -> Router:
    return router_class(name)(config)
