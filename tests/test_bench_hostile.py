"""`pbkv bench` regressions found by hostile testing: tiers and capacities given explicitly,
makespan of open-loop traces, the verdict's regime label, and plot lines."""

import pytest

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile
from pbkv.trace import Call, Trace, TraceMeta

PROFILE = load_profile("a6000-qwen3-32b")


def timed(offset: float) -> Workload:
    """Two one-call workflows arriving `offset` and `offset` + 1 s into the trace."""
    calls = [Call("a", 0, "x", 32, 2, [0, 1], t=offset), Call("b", 0, "x", 32, 2, [2, 3], t=offset + 1.0)]
    return Workload("t", Trace(TraceMeta(), calls))


def test_open_loop_makespan_runs_from_the_first_arrival():
    # the same two workflows, shifted 1000 s later: the same makespan, not 1000 s more
    early = simulate(timed(0.0), RunConfig("lru", None, PROFILE, cache=CacheConfig(device_tokens=1000)))
    late = simulate(timed(1000.0), RunConfig("lru", None, PROFILE, cache=CacheConfig(device_tokens=1000)))
    assert 1.0 < early["makespan_s"] < 100.0
    assert late["makespan_s"] == pytest.approx(early["makespan_s"])
