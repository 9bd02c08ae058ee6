"""The simulated engine against hand-computed costs, cache reuse, and bench determinism."""

import json
from dataclasses import dataclass, field

import pytest

from helpers import lost_load_calls
from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.bench.sweep import Source, SweepConfig, run_sweep
from pbkv.cache import CacheConfig, Capacities, RadixTree, TieredCache
from pbkv.driver import Recorder, Replay
from pbkv.engine.cost import CostModel
from pbkv.engine.profiles import load_profile
from pbkv.engine.simulator import Simulator
from pbkv.policy import PolicyContext, make_policy
from pbkv.trace import Call, Trace, TraceMeta

PROFILE = load_profile("a6000-qwen3-32b")


def one_workflow(*calls):
    return Workload("t", Trace(TraceMeta(block_size=16), list(calls)))


def simulator(workload, device=100_000, host=0, policy="lru"):
    cost = CostModel(PROFILE)
    pol = make_policy(policy, PolicyContext(agent_graph=workload.agent_graph))
    cache = TieredCache(RadixTree(16), Capacities(device, host), pol)
    pol.bind(cache)
    return Simulator(cost, cache, pol), cost


def run(workload, device=100_000, host=0, policy="lru", concurrency=1):
    engine, cost = simulator(workload, device, host, policy)
    rec = Replay(engine, workload.workflows, concurrency, Recorder()).run()
    return rec, engine, cost


def test_single_call_costs_prefill_plus_decode_steps():
    call = Call("w", 0, "a", 160, 5, list(range(10)))
    rec, _, cost = run(one_workflow(call))
    prefill = cost.prefill_seconds(cost.prefill_flops(160, 0))
    decode = 4 * cost.decode_step_seconds(1, 161)
    assert rec.latency == [pytest.approx(prefill + decode)]
    assert rec.ttft == [pytest.approx(prefill)]
    assert rec.recomputed == 160 and rec.device_hit == 0


def test_repeated_prompt_hits_the_device_cache_and_tool_wait_counts():
    a = Call("w", 0, "a", 160, 1, list(range(10)))
    b = Call("w", 1, "a", 176, 1, list(range(11)), tool_wait=2.0)
    rec, _, cost = run(one_workflow(a, b))
    assert rec.device_hit == 160 and rec.recomputed == 160 + 16
    second = cost.prefill_seconds(cost.prefill_flops(16, 160))
    assert rec.latency[0] == pytest.approx(cost.prefill_seconds(cost.prefill_flops(160, 0)) + 2.0 + second)


def test_evicted_prefix_comes_back_from_host_and_costs_a_load():
    calls = [Call("w", 0, "a", 160, 1, list(range(10))),
             Call("w", 1, "b", 160, 1, list(range(100, 110))),
             Call("w", 2, "a", 160, 1, list(range(10)))]
    rec, engine, cost = run(one_workflow(*calls), device=200, host=1000)
    assert rec.host_hit == 159 and rec.device_hit == 0  # the last token is always computed
    assert engine.stats.loads == 1
    assert engine.stats.load_seconds == pytest.approx(cost.load_seconds([0, 160, 0]))


def test_oversized_call_is_a_clear_error():
    wl = one_workflow(Call("w", 0, "a", 160, 1, list(range(10))))
    with pytest.raises(ValueError, match="needs 161 tokens, more than the device capacity of 100"):
        simulate(wl, RunConfig("lru", 1, PROFILE, cache=CacheConfig(device_tokens=100)))


def test_open_loop_starts_each_workflow_at_its_t_and_needs_every_t():
    @dataclass
    class Starts(Recorder):
        seen: dict = field(default_factory=dict)   # workflow id -> start time

        def workflow_started(self, i, workflow_id, now):
            super().workflow_started(i, workflow_id, now)
            self.seen[workflow_id] = now
    calls = [Call("a", 0, "x", 32, 2, [0, 1], t=0.0), Call("b", 0, "x", 32, 2, [2, 3], t=7.5)]
    wl = Workload("t", Trace(TraceMeta(), calls))
    engine = simulator(wl)[0]
    rec = Replay(engine, wl.workflows, None, Starts()).run()
    assert rec.seen == {"a": 0.0, "b": 7.5}
    untimed = Workload("t", Trace(TraceMeta(), [calls[0], Call("b", 0, "x", 32, 2, [2, 3])]))
    with pytest.raises(ValueError, match=r"the replay: --concurrency open replays each workflow's arrival "
                                         r"time \(`t` of its first call\), and 1 of 2 workflows have none "
                                         r"\(first: b\)"):
        Replay(engine, untimed.workflows, None, Recorder())


def test_open_loop_latency_does_not_depend_on_where_the_arrival_times_start():
    """Before: the clock ran from t = 0, so arrival times of epoch size (ns stamps read as
    Mooncake ms: 1.7e15 s) quantised latencies to 0.25 s, and at 1e300 they were all 0."""
    def latencies(offset, gap):   # gap: b's arrival after a's, exact at that offset
        calls = [Call("a", 0, "x", 320, 4, list(range(20)), t=offset),
                 Call("a", 1, "y", 480, 4, list(range(30)), tool_wait=0.003),
                 Call("b", 0, "x", 320, 4, list(range(40, 60)), t=offset + gap)]
        wl = Workload("t", Trace(TraceMeta(block_size=16), calls))
        rec = Replay(simulator(wl)[0], wl.workflows, None, Recorder()).run()
        return rec.latency, rec.ttft, rec.makespan()
    for offset, gap in ((2.0 ** 50, 0.5), (1e300, 0.0)):   # 2^50 s: a float step of 0.25 s
        base = latencies(0.0, gap)
        latency, ttft, makespan = latencies(offset, gap)
        assert latency == pytest.approx(base[0]) and ttft == pytest.approx(base[1])
        assert makespan == pytest.approx(base[2]) and min(ttft) > 0


def test_a_call_arriving_during_a_long_prefill_is_stamped_when_it_arrived():
    """Open loop: B arrives at 0.5 s while A's 16,000-token prefill runs (several seconds): B's
    TTFT and latency count from 0.5 s, so they include the wait for that pass."""
    a = Call("a", 0, "x", 16_000, 1, list(range(1000)), t=0.0)
    b = Call("b", 0, "x", 160, 1, list(range(2000, 2010)), t=0.5)
    wl = Workload("t", Trace(TraceMeta(block_size=16), [a, b]))
    engine, cost = simulator(wl)
    rec = Replay(engine, wl.workflows, None, Recorder()).run()
    first = cost.prefill_seconds(cost.prefill_flops(16_000, 0))
    second = cost.prefill_seconds(cost.prefill_flops(160, 0))
    assert first > 2
    expected = sorted([first, first - 0.5 + second])
    assert sorted(rec.ttft) == pytest.approx(expected) and sorted(rec.latency) == pytest.approx(expected)


def test_a_call_issued_after_a_tool_wait_during_a_prefill_is_stamped_at_its_issue_time():
    """Closed loop: workflow w's second call is issued 0.1 s after its first ends, while v's long
    prefill runs; its TTFT counts from that issue, not from the end of v's pass."""
    w0 = Call("w", 0, "x", 160, 1, list(range(10)))
    w1 = Call("w", 1, "x", 176, 1, list(range(11)), tool_wait=0.1)
    v0 = Call("v", 0, "y", 160, 1, list(range(3000, 3010)))
    v1 = Call("v", 1, "y", 16_000, 1, list(range(3000, 4000)), tool_wait=0.05)
    wl = Workload("t", Trace(TraceMeta(block_size=16), [w0, w1, v0, v1]))
    engine, cost = simulator(wl)
    rec = Replay(engine, wl.workflows, 2, Recorder()).run()
    both = cost.prefill_seconds(cost.prefill_flops(160, 0) * 2)       # w0 and v0 in one pass
    long = cost.prefill_seconds(cost.prefill_flops(16_000 - 160, 160))  # v1, issued at both + 0.05
    w1_prefill = cost.prefill_seconds(cost.prefill_flops(16, 160))
    issued = both + 0.1                                                  # during v1's pass
    assert both + 0.05 + long > issued + 1
    assert rec.ttft[-1] == pytest.approx(both + 0.05 + long + w1_prefill - issued)   # w1 ends last


def test_the_policy_is_told_a_call_started_when_it_was_issued_not_when_the_prefill_pass_ended():
    """B arrives 0.5 s into A's several-second prefill: `on_call_start` gets 0.5 s (policies
    learn tool waits and call gaps from it), while the engine's clock is already past the pass."""
    a = Call("a", 0, "x", 16_000, 1, list(range(1000)), t=0.0)
    b = Call("b", 0, "x", 160, 1, list(range(2000, 2010)), t=0.5)
    wl = Workload("t", Trace(TraceMeta(block_size=16), [a, b]))
    engine, cost = simulator(wl)
    seen, start = [], engine.policy.on_call_start
    engine.policy.on_call_start = lambda event: (seen.append((event.call.workflow_id, event.now, engine.now)),
                                                 start(event))
    Replay(engine, wl.workflows, None, Recorder()).run()
    first = cost.prefill_seconds(cost.prefill_flops(16_000, 0))
    assert seen == [("a", 0.0, 0.0), ("b", 0.5, pytest.approx(first))]


def test_a_blocked_queue_unpins_now_rather_than_waiting_for_an_unrelated_event():
    """Nothing runs; A cannot be admitted because B's loaded prefix pins device space. No event
    can free memory then, so the queued pins are released at once: A is not held back until C,
    an unrelated call 95 s later, arrives."""
    def blocks(a, n):
        return list(range(a, a + n))
    calls = [Call("w0", 0, "a", 160, 1, blocks(1, 10), t=0.0), Call("w1", 0, "a", 160, 1, blocks(101, 10), t=1.0),
             Call("w2", 0, "a", 320, 1, blocks(201, 20), t=2.0), Call("A", 0, "a", 320, 50, blocks(1, 20), t=5.0),
             Call("B", 0, "a", 176, 1, blocks(101, 11), t=5.001)]
    late = [Call("C", 0, "a", 16, 1, [500], t=100.0)]
    ttft = []
    for extra in ([], late):
        wl = Workload("t", Trace(TraceMeta(block_size=16), calls + extra))
        engine, _ = simulator(wl, device=400, host=4000)

        class ByWorkflow(Recorder):
            def call_finished(self, req):
                super().call_finished(req)
                if req.call.workflow_id == "A":
                    ttft.append(req.first_token - req.arrival)
        Replay(engine, wl.workflows, None, ByWorkflow()).run()
    assert ttft[0] < 0.1 and ttft[1] == pytest.approx(ttft[0])


def test_a_call_whose_loaded_prefix_was_lost_while_it_waited_counts_it_as_recomputed():
    """B loads its 64-token prefix from the host, its pin is released while A blocks the queue,
    and the prefix is pushed out of both tiers before B is admitted (`lost_load_calls`): B's
    prompt is prefilled whole, so its hits and recomputed tokens say so (it kept the hits
    counted when its load started: 64 from the host, 16 recomputed)."""
    wl = Workload("t", Trace(TraceMeta(block_size=16), lost_load_calls(16)))
    engine, _ = simulator(wl, device=400, host=96)
    served = {}

    class Served(Recorder):
        def call_finished(self, req):
            super().call_finished(req)
            served[req.call.workflow_id] = (req.hits()["device"], req.hits()["host"], req.recomputed,
                                            req.call.input_length - req.cached)
    rec = Replay(engine, wl.workflows, None, Served()).run()
    assert served["B"] == (0, 0, 80, 80) and served["A"] == (0, 16, 304, 304)
    assert engine.cache.stats.loaded[1] == 16 + 64   # B's load was made, and wasted
    assert rec.recomputed == sum(c.input_length for c in wl.trace.calls) - 16
    engine.cache.check()


def test_an_arrival_due_exactly_at_a_decode_step_end_costs_no_extra_step():
    """`late` arrives at F + k * dt, the float the engine reaches after k steps of `long`'s decode:
    it is prefilled at once (one 16-token prefill), whatever k (float rounding cost a step)."""
    cost = CostModel(PROFILE)
    first = cost.prefill_seconds(cost.prefill_flops(32, 0))
    dt = cost.decode_step_seconds(1, 33)
    quick = cost.prefill_seconds(cost.prefill_flops(16, 0))
    for k in (12, 13, 14, 26):
        t = first + k * dt   # the engine adds k * dt in one go: the same float
        calls = [Call("long", 0, "a", 32, 200, [1, 2], t=0.0), Call("late", 0, "a", 16, 1, [9], t=t)]
        wl = Workload("t", Trace(TraceMeta(block_size=16), calls))
        rec = Replay(simulator(wl)[0], wl.workflows, None, Recorder()).run()
        assert rec.ttft[0] == pytest.approx(quick, abs=1e-9), k


def test_a_prompt_held_whole_reserves_no_space_for_its_recomputed_last_token():
    """Step 1's 16-token prompt is cached whole; it recomputes its last token into the pinned
    block, so 16 + 200 outputs fit a 216-token device (it was refused one token short: stuck)."""
    calls = [Call("w", 0, "a", 16, 1, [1]), Call("w", 1, "a", 16, 200, [1])]
    rec, engine, _ = run(one_workflow(*calls), device=216)
    assert rec.calls == 2 and rec.device_hit == 15 and engine.cache.free(0) == 216 - 16   # its block stays cached


def test_closed_loop_runs_every_workflow_once_per_lane():
    wl = Workload("t", Trace(TraceMeta(), [Call(f"w{i}", 0, "a", 32, 2, [i * 2, i * 2 + 1]) for i in range(5)]))
    rec, _, _ = run(wl, concurrency=2)
    assert len(rec.latency) == 5 and rec.calls == 5


@pytest.fixture(scope="module")
def small_sweep():
    return SweepConfig(sources=[Source("hover", spec="hover", workflows=30, seed=3)],
                       policies=["lru", "kvflow", "oracle"], concurrency=[4, 16], cache=CacheConfig(device_tokens=20_000),
                       jobs=1)


def test_sweep_records_have_the_required_fields(small_sweep):
    records = run_sweep(small_sweep)
    assert [(r["policy"], r["concurrency"]) for r in records] == [
        ("lru", 4), ("kvflow", 4), ("oracle", 4), ("lru", 16), ("kvflow", 16), ("oracle", 16)]
    for r in records:
        for key in ("workload", "policy", "concurrency", "engine", "workflows", "calls", "mean_workflow_latency_s",
                    "p99_workflow_latency_s", "mean_ttft_s", "device_hit_rate", "host_hit_rate", "disk_hit_rate",
                    "recomputed_tokens", "bytes_loaded"):
            assert key in r
        assert ("speedup_vs_lru" in r) == (r["policy"] != "lru")
        assert r["workflows"] == 30 and r["engine"] == "sim"


def test_same_seed_gives_byte_identical_json(small_sweep):
    a = json.dumps(run_sweep(small_sweep))
    b = json.dumps(run_sweep(SweepConfig(**{**small_sweep.__dict__, "jobs": 2})))
    assert a == b


def test_two_requests_for_one_host_prefix_load_it_once():
    # both workflows evict P to host with their big middle calls, then ask for P at the same time
    def wf(name, other):
        return [Call(name, 0, "a", 160, 1, list(range(10))),
                Call(name, 1, "b", 160, 1, list(range(other, other + 10))),
                Call(name, 2, "a", 160, 1, list(range(10)))]
    wl = Workload("t", Trace(TraceMeta(block_size=16), wf("w1", 100) + wf("w2", 200)))
    rec, engine, _ = run(wl, device=400, host=1000, concurrency=2)
    assert engine.cache.stats.loaded[1] == 160 and engine.stats.loads == 1
    assert rec.host_hit == 159 and rec.device_hit == 159  # the second waited for the load, then hit
    engine.cache.check()


@pytest.mark.parametrize("data, message", [
    (b"\xff{}", r"p.json: not UTF-8 text \(byte 0xff at offset 0\)"),
    (b"[]", r"p.json: expected a JSON object, got list"),
    (b'{"name": 3}', r"p.json: field 'name': Input should be a valid string, got 3"),
    (None, r"unknown profile '.*nope.json' \(no such file\)"),
], ids=["not-utf-8", "a-list", "bad-field", "missing"])
def test_a_bad_profile_file_is_named_with_what_is_wrong(tmp_path, data, message):
    path = tmp_path / ("nope.json" if data is None else "p.json")
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        load_profile(str(path))


def test_a_far_event_during_a_decode_run_costs_no_overflow():
    """A tool wait of 1e307 s is a valid trace value: the decode run in progress is not divided
    by it (the step count overflowed to inf: OverflowError)."""
    calls = [Call("a", 0, "x", 32, 50, [0, 1]), Call("b", 0, "x", 32, 1, [2, 3]),
             Call("b", 1, "x", 48, 1, [2, 3, 4], tool_wait=1e307)]
    rec, _, _ = run(Workload("t", Trace(TraceMeta(block_size=16), calls)), concurrency=2)
    assert rec.calls == 3
