"""Where `--device-tokens`, `--host-tokens` and `--disk-tokens` become tier capacities.

`CacheConfig` is what a user asked for (None: "the engine's default"); `CapacityDefaults` is
what one engine falls back to; `CacheConfig.resolve(defaults)` is the one rule that combines
them, used by every engine:

- device = the given tokens, else `defaults.device`;
- host, disk = the given tokens, else `*_ratio` x the resolved device when the engine sets a
  ratio, else the engine's fixed `host` / `disk` tokens.

The engines' defaults (see each call site): the simulator takes the profile (device from GPU
memory, host = profile host_ratio x device, disk = the profile's); the real engine 8 x the
longest call, host_ratio x device, 8 x device; `pbkv serve` 16384, 2 x, 4 x; `--engine vllm`
24 blocks of 32 tokens, 512, 16384; the vLLM connector vLLM's pool, 4 x, 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from pbkv.cache.parts import Capacities


@dataclass(frozen=True)
class CapacityDefaults:
    """One engine's capacities for what the user left out, in tokens (see the module docstring)."""

    device: int
    host_ratio: float | None = None   # host = int(device x ratio) ...
    host: int = 0                     # ... or this many tokens when no ratio is set
    disk_ratio: float | None = None
    disk: int = 0


@dataclass(frozen=True)
class CacheConfig:
    """The cache a user asked for. `block_size` and `disk_dir` are used where the engine owns
    them (`pbkv serve`); a replayed trace carries its own block size. `shared_dir`: a directory
    of KV blocks shared with other engines (`pbkv.engine.shared_kv`; None: no shared tier),
    bounded to `shared_bytes` (None: the engine's default, 8 GiB)."""

    device_tokens: int | None = None
    host_tokens: int | None = None
    disk_tokens: int | None = None
    block_size: int = 16
    disk_dir: str | None = None
    shared_dir: str | None = None
    shared_bytes: int | None = None

    def resolve(self, defaults: CapacityDefaults) -> Capacities:
        """The tier sizes: what was given, the rest from `defaults` (0 device tokens: the default)."""
        device = self.device_tokens or defaults.device
        return Capacities(device, _tier(self.host_tokens, defaults.host_ratio, defaults.host, device),
                          _tier(self.disk_tokens, defaults.disk_ratio, defaults.disk, device))


def _tier(given: int | None, ratio: float | None, fixed: int, device: int) -> int:
    if given is not None:
        return given
    return int(device * ratio) if ratio is not None else fixed
