"""What both engines share (`pbkv.engine.base`) and the one run builder (`pbkv.bench.runner`)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from pbkv.bench.run import RunConfig, SimSetup, Workload, simulate
from pbkv.bench.runner import policy_predictors, run_workload
from pbkv.cache import Capacities, RadixTree, Tier, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.engine.base import EventQueue, tokens_by_tier
from pbkv.engine.cost import CostModel
from pbkv.engine.profiles import load_profile
from pbkv.engine.simulator import SimulationError, Simulator
from pbkv.policy import PolicyContext, make_policy
from pbkv.predict import cached
from pbkv.trace import Call, Trace, TraceMeta

PROFILE = load_profile("a6000-qwen3-32b")
HOOKS = ("on_workflow_start", "on_workflow_end", "on_call_start", "on_prefill", "on_call_end", "prefetch")


def workload(*calls):
    return Workload("t", Trace(TraceMeta(block_size=16), list(calls)))


def test_events_fire_by_time_then_scheduling_order_and_chain():
    q, fired = EventQueue(), []
    q.push(2.0, lambda: fired.append("late"))
    q.push(1.0, lambda: fired.append("b"))
    q.push(1.0, lambda: (fired.append("c"), q.push(0.5, lambda: fired.append("chained"))))
    q.fire_due(lambda: 1.5)
    assert fired == ["b", "c", "chained"]
    assert q and q.next_time() == 2.0 and q.scheduled == 4
    q.fire_due(lambda: 2.0)
    assert fired[-1] == "late" and not q


def test_tokens_by_tier_counts_each_tier():
    nodes = [SimpleNamespace(tier=Tier.DEVICE, tokens=16), SimpleNamespace(tier=Tier.DISK, tokens=5),
             SimpleNamespace(tier=Tier.HOST, tokens=32), SimpleNamespace(tier=Tier.DISK, tokens=16)]
    assert tokens_by_tier(nodes) == [16, 32, 21]
    assert tokens_by_tier([]) == [0, 0, 0]


def test_every_policy_hook_is_counted_and_timed():
    wl = workload(Call("w", 0, "a", 160, 5, list(range(10))), Call("w", 1, "b", 200, 5, list(range(13))))
    pol = make_policy("lru", PolicyContext(agent_graph=wl.agent_graph))
    calls = []
    for name in HOOKS:
        hook = getattr(pol, name)
        setattr(pol, name, lambda *a, hook=hook, name=name: (calls.append(name), hook(*a))[1])
    engine = Simulator(CostModel(PROFILE), TieredCache(RadixTree(16), Capacities(100_000, 1000), pol), pol)
    Replay(engine, wl.workflows, 1, Recorder()).run()
    assert calls.count("on_call_start") == calls.count("on_call_end") == 2
    assert engine.stats.policy_calls == len(calls) and engine.stats.policy_seconds > 0


def test_simulator_stuck_message_names_call_need_and_capacity():
    wl = workload(Call("w", 0, "a", 160, 5, list(range(10))))
    pol = make_policy("lru", PolicyContext())
    engine = Simulator(CostModel(PROFILE), TieredCache(RadixTree(16), Capacities(100, 0), pol), pol)
    with pytest.raises(SimulationError, match="^stuck: call w step 0 needs 165 device tokens; "
                                              "capacity 100, evictable 0$"):
        Replay(engine, wl.workflows, 1, Recorder()).run()


def test_predictions_are_batched_unless_they_must_be_live(monkeypatch):
    wl = workload(Call("w", 0, "a", 160, 5, list(range(10))))
    monkeypatch.setattr(cached, "CachedPredictor", lambda p, workflows: ("batched", p, workflows))
    trained = object()
    for options, batched in (({}, True), ({"online_learner": object()}, False), ({"live_predictions": True}, False)):
        cfg = RunConfig("lru", 1, PROFILE, **options, predictors={"v": trained})
        got = policy_predictors(wl, cfg)["v"]
        assert got == ("batched", trained, wl.workflows) if batched else got is trained


class FailingSetup(SimSetup):
    closed = 0

    def make_engine(self, cache, policy):
        engine = super().make_engine(cache, policy)
        engine.run = lambda: (_ for _ in ()).throw(RuntimeError("engine failed"))
        return engine

    def close(self, engine):
        FailingSetup.closed += 1


def test_run_workload_closes_the_engine_when_the_run_fails():
    wl = workload(Call("w", 0, "a", 160, 5, list(range(10))))
    cfg = RunConfig("lru", 1, PROFILE)
    with pytest.raises(RuntimeError, match="engine failed"):
        run_workload(wl, cfg, FailingSetup(CostModel(PROFILE), 1))
    assert FailingSetup.closed == 1
    record = simulate(wl, cfg)
    assert record["calls"] == 1 and record["device_tokens"] == cfg.capacities().device


def test_engine_layer_does_not_import_the_real_engine():
    code = ("import sys, pbkv.engine.base, pbkv.engine.simulator, pbkv.engine.request, pbkv.driver, pbkv.bench.run; "
            "print(sorted(m for m in sys.modules if m.startswith('pbkv.engine.hf') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
