"""LRU: evict the least recently used leaf of a tier; keep evicted nodes in the next tier down.

This is SGLang's radix cache with HiCache (device LRU, host LRU, write-back on eviction): the
baseline of the PBKV and KVFlow papers."""

from __future__ import annotations

from pbkv.policy.base import Policy


class LRUPolicy(Policy):
    name = "lru"
    # Ranking (last_access,) and keep-everything are the base class defaults.
