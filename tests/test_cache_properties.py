"""Invariants of the cache under random operation sequences (hypothesis), for every policy."""

from hypothesis import given, settings, strategies as st

from helpers import BLOCK, ids, make_cache
from pbkv.cache import Tier
from pbkv.policy import PolicyContext
from pbkv.policy.future import Future
from pbkv.trace import Call

PROMPTS = st.text(alphabet="abc", min_size=1, max_size=6)
OPS = st.lists(st.one_of(
    st.tuples(st.just("serve"), PROMPTS, st.integers(0, 3), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.sampled_from(list(Tier)), st.integers(1, 12 * BLOCK)),
    st.tuples(st.just("end"), st.integers(0, 3)),
    st.tuples(st.just("prefetch"), st.integers(0, 50)),
), max_size=60)


def _ctx(policy):
    if policy != "oracle":
        return PolicyContext(block_size=BLOCK, agent_graph={"START": ["x"], "x": ["y"], "y": ["x", "END"]})
    calls = [Call(f"w{i}", 0, "x", len(p) * BLOCK, 1, ids(p)) for i, p in enumerate(["abc", "ab", "cab"])]
    return PolicyContext(block_size=BLOCK, future=Future([[c] for c in calls], BLOCK, 2, lambda c: 1.0))


def run_ops(policy, device, host, disk, ops):
    cache, pol = make_cache(device, host, disk, policy=policy, ctx=_ctx(policy))
    tree = cache.tree
    held = []  # (node, reserved) pins held by "running requests"
    now = 0.0
    for op in ops:
        now += 1.0
        if op[0] == "serve":
            _, prompt, wf, partial = op
            h = ids(prompt)
            tail = 2 if partial else BLOCK
            node, matched = tree.match(h)
            path = node.path() if matched else []
            lower = [n for n in path if n.tier != Tier.DEVICE]
            if lower:
                move = cache.prepare_load(lower, keep_lock=False)
                if move is None:
                    continue
                cache.complete(move)
            pin = path[-1] if path else None
            if pin is not None:
                tree.lock(pin)
            need = len(h) * BLOCK
            if not cache.reserve(need):
                if pin is not None:
                    tree.unlock(pin)
                continue
            try:
                leaf, added = cache.insert(h, tail, now)
            except Exception:  # extending a partial tail block: not a valid chained prompt
                cache.release(need)
                if pin is not None:
                    tree.unlock(pin)
                continue
            cache.release(need - added)
            tree.lock(leaf)
            if pin is not None:
                tree.unlock(pin)
            tree.touch(leaf, now, wf, "xy"[wf % 2])
            held.append(leaf)
        elif op[0] == "release" and held:
            tree.unlock(held.pop(op[1] % len(held)))
        elif op[0] == "evict":
            _, tier, n = op
            before = (list(cache.usage), cache.stats.evictions)
            ok = cache.evict(tier, n)
            if not ok:
                assert (list(cache.usage), cache.stats.evictions) == before  # atomic
        elif op[0] == "end":
            cache.end_workflow(op[1])
        elif op[0] == "prefetch":
            below = [n for n in tree.iter_nodes() if n.tier != Tier.DEVICE and n.parent.tier == Tier.DEVICE
                     and n.lock == 0]
            if below:
                move = cache.prepare_load([below[op[1] % len(below)]], keep_lock=False, allow_evict=False)
                if move is not None:
                    cache.complete(move)
        cache.check()
        for node in held:  # pinned nodes are never evicted
            assert node.alive and node.tier == Tier.DEVICE
            for anc in node.path():
                assert anc.tier == Tier.DEVICE and anc.lock > 0


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(6, 24), st.integers(0, 16), st.integers(0, 16))
def test_invariants_lru(ops, device, host, disk):
    run_ops("lru", device * BLOCK, host * BLOCK, disk * BLOCK, ops)


@settings(max_examples=40, deadline=None)
@given(OPS, st.integers(6, 24), st.integers(0, 16), st.integers(0, 16))
def test_invariants_kvflow(ops, device, host, disk):
    run_ops("kvflow", device * BLOCK, host * BLOCK, disk * BLOCK, ops)


@settings(max_examples=40, deadline=None)
@given(OPS, st.integers(6, 24), st.integers(0, 16), st.integers(0, 16))
def test_invariants_oracle(ops, device, host, disk):
    run_ops("oracle", device * BLOCK, host * BLOCK, disk * BLOCK, ops)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["slru", "arc", "continuum", "scalesim"]), OPS, st.integers(6, 24), st.integers(0, 16),
       st.integers(0, 16))
def test_invariants_peers(policy, ops, device, host, disk):
    run_ops(policy, device * BLOCK, host * BLOCK, disk * BLOCK, ops)
