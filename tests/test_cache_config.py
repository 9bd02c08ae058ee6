"""`CacheConfig.resolve`: the one rule that turns --device/--host/--disk-tokens into capacities."""

import pytest

from pbkv.bench.hf_run import hf_capacities
from pbkv.bench.run import RunConfig, Workload
from pbkv.bench.vllm_run import VLLMConfig
from pbkv.cache import CacheConfig, Capacities, CapacityDefaults
from pbkv.engine.profiles import load_profile
from pbkv.trace import Call, Trace, TraceMeta

PROFILE = load_profile("a6000-qwen3-32b")


def test_given_values_win_and_unset_ones_come_from_the_defaults():
    ratio = CapacityDefaults(1000, host_ratio=2.5, disk_ratio=4)
    assert CacheConfig().resolve(ratio) == Capacities(1000, 2500, 4000)
    assert CacheConfig(device_tokens=64).resolve(ratio) == Capacities(64, 160, 256)      # ratios of the given device
    assert CacheConfig(64, 7, 0).resolve(ratio) == Capacities(64, 7, 0)                  # 0 disables a tier
    assert CacheConfig(64, 0, 0).resolve(ratio) == Capacities(64, 0, 0)
    fixed = CapacityDefaults(1000, host=512, disk=16384)
    assert CacheConfig(device_tokens=64).resolve(fixed) == Capacities(64, 512, 16384)
    with pytest.raises(ValueError, match="capacities must be >= 0"):
        CacheConfig(host_tokens=-1).resolve(fixed)


def test_each_engine_keeps_its_defaults():
    # simulator: the profile (device from GPU memory, host = host_ratio x device, disk = the profile's)
    sim = RunConfig("lru", 4, PROFILE).capacities()
    assert sim == Capacities(PROFILE.device_tokens, int(PROFILE.device_tokens * PROFILE.host_ratio), PROFILE.disk_tokens)
    assert RunConfig("lru", 4, PROFILE, cache=CacheConfig(device_tokens=100)).capacities().host == int(100 * PROFILE.host_ratio)
    # real engine: 8 x the longest call, host_ratio x device, 8 x device
    wl = Workload("t", Trace(TraceMeta(block_size=16), [Call("w", 0, "a", 90, 10, [1, 2, 3, 4, 5, 6])]))
    assert hf_capacities(wl, RunConfig("lru", 1, PROFILE)) == Capacities(800, int(800 * PROFILE.host_ratio), 6400)
    # vLLM bench: 24 blocks of 32, 512, 16384; a given device size is rounded up to whole blocks
    assert VLLMConfig().with_cache(CacheConfig()) == VLLMConfig()
    sized = VLLMConfig().with_cache(CacheConfig(device_tokens=100, disk_tokens=0))
    assert (sized.blocks, sized.host_tokens, sized.disk_tokens) == (4, 512, 0)


def test_serve_defaults():
    pytest.importorskip("fastapi")
    from pbkv.serve import ServeConfig
    assert ServeConfig().capacities() == Capacities(16384, 32768, 65536)
    assert ServeConfig(cache=CacheConfig(device_tokens=100, disk_tokens=0)).capacities() == Capacities(100, 200, 0)


def test_a_disk_below_no_host_tier_is_refused_or_dropped():
    # evictions go device -> host -> disk: with host 0 nothing ever reaches the disk
    ratio = CapacityDefaults(1000, host_ratio=2.5, disk_ratio=4)
    with pytest.raises(ValueError, match=r"--disk-tokens 7 with --host-tokens 0: .* give --host-tokens > 0, "
                                         r"or --disk-tokens 0"):
        CacheConfig(64, 0, 7).resolve(ratio)
    with pytest.raises(ValueError, match="--disk-tokens 7 with --host-tokens 0"):
        CacheConfig(64, 0, 7).check()     # the same error before any work
    with pytest.raises(ValueError, match="--disk-tokens 7 with a host tier of 0 tokens"):
        CacheConfig(64, None, 7).resolve(CapacityDefaults(1000, host_ratio=0))
    # a default disk below host 0 (the real engine's 8 x device) is no tier at all: 0
    assert CacheConfig(64, 0).resolve(ratio) == Capacities(64, 0, 0)
