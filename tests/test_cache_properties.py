"""Invariants of the cache under random operation sequences (hypothesis), for every policy.

The run drives the policy's hooks the way an engine does (workflow start at a workflow's first
call, call start/end around each insert, workflow end after `TieredCache.end_workflow`, prefetch
candidates from `Policy.prefetch`), so PBKV's scores, retired set and trust change as it runs.
"""

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from helpers import BLOCK, FakePredictor, ids, make_cache
from pbkv.cache import Tier
from pbkv.policy import CallEvent, PolicyContext, PrefetchRequest
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


# A deterministic stand-in for a trained predictor over agents (x, y, <unk>), horizon 2:
# after x it expects y then x, after y it expects x or the end; anything else is uniform.
PREDICTIONS = {"x": ([[0.1, 0.9, 0.0], [0.8, 0.2, 0.0]], [1.0, 0.7]),
               "y": ([[0.6, 0.3, 0.1], [0.5, 0.5, 0.0]], [0.5, 0.4])}


def _ctx(policy):
    if policy.startswith("pbkv"):
        predictor = FakePredictor(["x", "y"], 2, PREDICTIONS)
        return PolicyContext(block_size=BLOCK, predictors={"fused": predictor})
    if policy != "oracle":
        return PolicyContext(block_size=BLOCK, agent_graph={"START": ["x"], "x": ["y"], "y": ["x", "END"]})
    calls = [Call(f"w{i}", 0, "x", len(p) * BLOCK, 1, ids(p)) for i, p in enumerate(["abc", "ab", "cab"])]
    return PolicyContext(block_size=BLOCK, future=Future([[c] for c in calls], BLOCK, 2, lambda c: 1.0))


class Run:
    """One random run: the cache, the policy, the pins held by "running requests" and, when
    `hooks` is set, the policy's view of workflows (started ids, next step of each)."""

    def __init__(self, policy, device, host, disk, hooks):
        self.cache, self.pol = make_cache(device, host, disk, policy=policy, ctx=_ctx(policy))
        self.tree = self.cache.tree
        self.hooks = hooks
        self.held = []  # leaves pinned by running requests
        self.steps: dict[int, int] = {}  # started workflow -> its next step
        self.now = 0.0

    def event(self, wf, node, hash_ids):
        step = self.steps[wf]
        call = SimpleNamespace(context=None, workflow_id=f"w{wf}", step=step, hash_ids=hash_ids)
        return CallEvent(wf, "xy"[(wf + step) % 2], step, call, node, self.now)

    def serve(self, prompt, wf, partial):
        cache, tree = self.cache, self.tree
        if self.hooks and wf not in self.steps:
            self.pol.on_workflow_start(wf, f"w{wf}")
            self.steps[wf] = 0
        h = ids(prompt)
        node, matched = tree.match(h)
        if self.hooks:
            self.pol.on_call_start(self.event(wf, node, h))
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
        leaf = self._insert(h, BLOCK if not partial else 2, need)
        if pin is not None:
            tree.unlock(pin)
        if leaf is None:
            return
        tree.touch(leaf, self.now, wf, "xy"[wf % 2])
        self.held.append(leaf)
        if self.hooks:
            self.pol.on_call_end(self.event(wf, leaf, h))
            self.steps[wf] += 1

    def _insert(self, h, tail, need):
        """Reserve, insert and pin the leaf; None when there is no room or the prompt would
        extend a partial tail block (not a valid chained prompt)."""
        if not self.cache.reserve(need):
            return None
        try:
            leaf, added = self.cache.insert(h, tail, self.now)
        except Exception:
            self.cache.release(need)
            return None
        self.cache.release(need - added)
        self.tree.lock(leaf)
        return leaf

    def end(self, wf):
        nodes = self.cache.end_workflow(wf)
        if self.hooks and self.steps.pop(wf, None) is not None:
            self.pol.on_workflow_end(wf, nodes)

    def prefetch(self, pick):
        """Load what the policy asks for (else a random candidate), with the ancestors it needs."""
        cache = self.cache
        wanted = []
        if self.hooks:
            wanted = self.pol.prefetch(PrefetchRequest(pick * BLOCK, cache.free(Tier.DEVICE), self.now))
        if not wanted:
            wanted = [n for n in self.tree.iter_nodes() if n.tier != Tier.DEVICE
                      and n.parent.tier == Tier.DEVICE and n.lock == 0]
            wanted = [wanted[pick % len(wanted)]] if wanted else []
        for node in wanted[:2]:
            segment = cache.below_device(node) if node.alive else []
            if segment and all(n.lock == 0 for n in segment):
                move = cache.prepare_load(segment, keep_lock=False, allow_evict=False)
                if move is not None:
                    cache.complete(move)

    def evict(self, tier, n):
        before = (list(self.cache.usage), self.cache.stats.evictions)
        if not self.cache.evict(tier, n):
            assert (list(self.cache.usage), self.cache.stats.evictions) == before  # atomic

    def check(self):
        self.cache.check()
        for node in self.held:  # pinned nodes are never evicted
            assert node.alive and node.tier == Tier.DEVICE
            for anc in node.path():
                assert anc.tier == Tier.DEVICE and anc.lock > 0


def run_ops(policy, device, host, disk, ops, hooks=True):
    run = Run(policy, device, host, disk, hooks)
    for op in ops:
        run.now += 1.0
        if op[0] == "serve":
            run.serve(*op[1:])
        elif op[0] == "release" and run.held:
            run.tree.unlock(run.held.pop(op[1] % len(run.held)))
        elif op[0] == "evict":
            run.evict(*op[1:])
        elif op[0] == "end":
            run.end(op[1])
        elif op[0] == "prefetch":
            run.prefetch(op[1])
        run.check()
    return run


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
    # the oracle's future is a fixed three-workflow trace, which random workflow ids would leave:
    # its hooks are not driven (its order is the trace's next use either way)
    run_ops("oracle", device * BLOCK, host * BLOCK, disk * BLOCK, ops, hooks=False)


@settings(max_examples=40, deadline=None)
@given(OPS, st.integers(6, 24), st.integers(0, 16), st.integers(0, 16))
def test_invariants_pbkv(ops, device, host, disk):
    run_ops("pbkv", device * BLOCK, host * BLOCK, disk * BLOCK, ops)


@settings(max_examples=40, deadline=None)
@given(OPS, st.integers(6, 24), st.integers(0, 16), st.integers(0, 16))
def test_invariants_pbkv_retired(ops, device, host, disk):
    run_ops("pbkv-retired", device * BLOCK, host * BLOCK, disk * BLOCK, ops)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["slru", "arc", "continuum", "scalesim"]), OPS, st.integers(6, 24), st.integers(0, 16),
       st.integers(0, 16))
def test_invariants_peers(policy, ops, device, host, disk):
    run_ops(policy, device * BLOCK, host * BLOCK, disk * BLOCK, ops)
