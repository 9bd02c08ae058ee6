"""The mechanism: a radix tree of token blocks over device/host/disk tiers, with locks, tags,
capacities, atomic eviction in a policy's order and two-phase moves. No policy logic here."""

from pbkv.cache.config import CacheConfig, CapacityDefaults
from pbkv.cache.node import Node, Tier
from pbkv.cache.parts import Capacities, CacheStats, EvictionRules, Move, Storage
from pbkv.cache.tiered import TieredCache
from pbkv.cache.tree import RadixTree, TreeError

__all__ = ["Node", "Tier", "RadixTree", "TreeError", "TieredCache", "Capacities", "CacheStats",
           "EvictionRules", "Move", "Storage", "CacheConfig", "CapacityDefaults"]
