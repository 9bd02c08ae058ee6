"""Cache invariants under random operation sequences with the PBKV policies, driven through the
policy's own hooks (call start/end, workflow end, prefetch), `check()` after every operation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from helpers import BLOCK, FakePredictor, ids, make_cache
from pbkv.cache import Tier
from pbkv.engine.prefetch import prepare_prefetches
from pbkv.policy import CallEvent, PolicyContext, PrefetchRequest

POLICIES = ["pbkv", "pbkv-noprefetch", "pbkv-history", "pbkv-context", "pbkv-retired"]
PROMPTS = st.text(alphabet="abc", min_size=1, max_size=6)
OPS = st.lists(st.one_of(
    st.tuples(st.just("serve"), PROMPTS, st.integers(0, 3), st.sampled_from("xyz"), st.booleans()),
    st.tuples(st.just("arrive"), PROMPTS, st.integers(0, 3), st.sampled_from("xyz")),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.sampled_from(list(Tier)), st.integers(1, 4 * BLOCK)),
    st.tuples(st.just("end"), st.integers(0, 3)),
    st.tuples(st.just("prefetch"), st.integers(0, 40 * BLOCK)),
), min_size=10, max_size=50)


class Driver:
    """Plays an engine's part: workflows, calls (load, pin, reserve, insert, tag), prefetches."""

    def __init__(self, policy, device, host, disk):
        pred = FakePredictor(["x", "y", "z"], 3)
        ctx = PolicyContext(block_size=BLOCK, predictors={v: pred for v in ("fused", "history", "context")})
        self.cache, self.pol = make_cache(device, host, disk, policy=policy, ctx=ctx)
        self.pol.bind(self.cache, lambda: self.now)
        self.now, self.held, self.steps = 0.0, [], {}
        self.waiting = {}   # workflow -> (prompt, agent, step) of its call that arrived, not served

    def arrive(self, prompt, wf, agent):
        """A call arrives and waits (the policy may load its prefix ahead); `serve` serves it."""
        if wf in self.waiting:
            return
        if wf not in self.steps:
            self.steps[wf] = 0
            self.pol.on_workflow_start(wf, f"w{wf}")
        step = self.steps[wf]
        node, _ = self.cache.tree.match(ids(prompt))
        event = SimpleNamespace(context=None, workflow_id=f"w{wf}", step=step)
        self.pol.on_call_start(CallEvent(wf, agent, step, event, node, self.now))
        self.steps[wf] += 1
        self.waiting[wf] = (prompt, agent, step)

    def serve(self, prompt, wf, agent, running):
        """One call (the one waiting in `wf`, if any); `running`: it stays in flight (its path
        pinned) until a `release`."""
        cache, tree, pol = self.cache, self.cache.tree, self.pol
        if wf in self.waiting:
            prompt, agent, step = self.waiting.pop(wf)
        else:
            self.arrive(prompt, wf, agent)
            prompt, agent, step = self.waiting.pop(wf)
        h = ids(prompt)
        node, matched = tree.match(h)
        event = SimpleNamespace(context=None, workflow_id=f"w{wf}", step=step)
        if matched and node.end > matched:
            node = tree.split(node, matched - node.start)
        path = node.path() if matched else []
        lower = [n for n in path if n.tier != Tier.DEVICE]
        if lower:
            move = cache.prepare_load(lower, keep_lock=False)
            if move is None:
                return
            cache.complete(move)
        pin = path[-1] if path else None
        if pin is not None:
            tree.lock(pin)
        need = len(h) * BLOCK
        if not cache.reserve(need):
            if pin is not None:
                tree.unlock(pin)
            return
        leaf, added = cache.insert(h, BLOCK, self.now)
        cache.release(need - added)
        tree.lock(leaf)
        if pin is not None:
            tree.unlock(pin)
        tree.touch(leaf, self.now, wf, agent)
        cache.refresh(leaf)
        pol.on_call_end(CallEvent(wf, agent, step, event, leaf, self.now))
        if running:
            self.held.append(leaf)
        else:
            tree.unlock(leaf)

    def end(self, wf):
        self.waiting.pop(wf, None)
        if self.steps.pop(wf, None) is not None:
            self.pol.on_workflow_end(wf, self.cache.end_workflow(wf))

    def prefetch(self, budget):
        """Load what the policy asks for; no load may push out a node the policy ranked at or
        above the load's floor (`prefetch_floor`: a queued call's arrival, else retired only)."""
        cache, pol = self.cache, self.pol
        wanted = pol.prefetch(PrefetchRequest(budget, cache.free(Tier.DEVICE), self.now))
        moves = prepare_prefetches(cache, wanted, budget, pol.allow_evict_for_prefetch, lambda n: False,
                                   pol.prefetch_floor)
        while True:
            before = [(n, pol.priority(n)) for n in cache.tree.iter_nodes() if n.tier == Tier.DEVICE]
            move = next(moves, None)
            if move is None:
                return
            floor = pol.prefetch_floor(move[0].nodes[-1])
            gone = [key for n, key in before if not (n.alive and n.tier == Tier.DEVICE)]
            assert floor is None or all(key < floor for key in gone), (floor, gone)
            cache.complete(move[0])


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=OPS, device=st.integers(6, 14), host=st.sampled_from([0, 3, 8]), disk=st.sampled_from([0, 6]))
def test_pbkv_policies_keep_the_cache_invariants(policy, ops, device, host, disk):
    d = Driver(policy, device * BLOCK, host * BLOCK, disk * BLOCK)
    cache = d.cache
    for op in ops:
        d.now += 1.0
        if op[0] == "serve":
            d.serve(*op[1:])
        elif op[0] == "arrive":
            d.arrive(*op[1:])
        elif op[0] == "release" and d.held:
            cache.tree.unlock(d.held.pop(op[1] % len(d.held)))
        elif op[0] == "evict":
            before = (list(cache.usage), cache.stats.evictions)
            if not cache.evict(op[1], op[2]):
                assert (list(cache.usage), cache.stats.evictions) == before  # atomic
        elif op[0] == "end":
            d.end(op[1])
        elif op[0] == "prefetch":
            d.prefetch(op[1])
        cache.check()
        candidates = cache.candidates(Tier.DEVICE)
        assert all(n.lock == 0 and n.alive for n in candidates)
