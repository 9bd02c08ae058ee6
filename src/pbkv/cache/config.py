"""Where `--device-tokens`, `--host-tokens` and `--disk-tokens` become tier capacities.

`CacheConfig` is what a user asked for (None: "the engine's default"); `CapacityDefaults` is
what one engine falls back to; `CacheConfig.resolve(defaults)` is the one rule that combines
them, used by every engine:

- device = the given tokens, else `defaults.device`;
- host, disk = the given tokens, else `*_ratio` x the resolved device when the engine sets a
  ratio, else the engine's fixed `host` / `disk` tokens;
- a disk needs a host tier above it: blocks evicted from the device go one tier down
  (`pbkv.cache.tiered`), so with no host tier nothing ever reaches the disk. A given disk size
  with host 0 is an error (`DiskWithoutHost`); a default disk below host 0 becomes 0.

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
    bounded to `shared_bytes` (None: the engine's default, 8 GiB; the bound holds with up to 4
    writers: `pbkv.engine.shared_kv`)."""

    device_tokens: int | None = None
    host_tokens: int | None = None
    disk_tokens: int | None = None
    block_size: int = 16
    disk_dir: str | None = None
    shared_dir: str | None = None
    shared_bytes: int | None = None

    def resolve(self, defaults: CapacityDefaults) -> Capacities:
        """The tier sizes: what was given, the rest from `defaults` (0 device tokens: the default).
        Never a disk below an empty host tier (see the module docstring)."""
        self.check()
        device = self.device_tokens or defaults.device
        host = _tier(self.host_tokens, defaults.host_ratio, defaults.host, device)
        disk = _tier(self.disk_tokens, defaults.disk_ratio, defaults.disk, device)
        if host == 0 and disk > 0:
            if self.disk_tokens is not None:   # the default host was 0 (e.g. a profile's host_ratio)
                raise DiskWithoutHost(disk, given_host=False)
            disk = 0   # a default disk could never be reached without a host tier: say so in the record
        return Capacities(device, host, disk)

    def check(self) -> None:
        """Raise `DiskWithoutHost` for --host-tokens 0 with --disk-tokens > 0 (callers check
        before any work; `resolve` checks again)."""
        if self.host_tokens == 0 and self.disk_tokens:
            raise DiskWithoutHost(self.disk_tokens, given_host=True)


class DiskWithoutHost(ValueError):
    """A disk tier asked for below no host tier: it would never be used (evictions go device ->
    host -> disk, one tier at a time), so it is refused rather than silently left empty."""

    def __init__(self, disk: int, given_host: bool):
        host = "--host-tokens 0" if given_host else "a host tier of 0 tokens (the engine's default)"
        super().__init__(f"--disk-tokens {disk} with {host}: blocks evicted from the device reach the disk "
                         f"only through the host tier, so the disk would never be used; give --host-tokens > 0, "
                         f"or --disk-tokens 0 (or leave it out)")


def _tier(given: int | None, ratio: float | None, fixed: int, device: int) -> int:
    if given is not None:
        return given
    return int(device * ratio) if ratio is not None else fixed
