"""Routing calls across engine replicas (simulator instances or Ray Serve replicas).

`make_router(name)` builds a router from the registry; a router's `choose(request, views)`
returns a `RouteDecision`. See `pbkv.route.base` for the interface and its invariants.
"""

from pbkv.route.base import (BadDecision, NoReplicas, ReplicaView, RouteDecision, Router, RouterConfig,
                             RouteRequest, check_decision)
from pbkv.route.registry import UnknownRouter, make_router, register, router_class, router_names
from pbkv.route.view import ReplicaSnapshot

__all__ = ["BadDecision", "NoReplicas", "ReplicaSnapshot", "ReplicaView", "RouteDecision", "RouteRequest", "Router",
           "RouterConfig", "UnknownRouter", "check_decision", "make_router", "register", "router_class", "router_names"]
