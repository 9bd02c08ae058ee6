"""The scheduler side of the connector: pbkv's radix tree and policy over vLLM's blocks.

Imports no vLLM, so it is unit-tested in the main venv. The tree's tiers mean:
- DEVICE: vLLM's GPU prefix cache as pbkv models it (capacity `device_tokens`, default vLLM's
  whole KV pool). Every node here also has a host-RAM mirror written at compute time: a
  connector can read KV only while a request runs, so the copy that an eviction to host would
  need must already exist. The mirror is not counted against `host_tokens`;
- HOST: the connector's RAM tier (`host_tokens`);
- DISK: one safetensors file per block (`disk_tokens`), sha256-checked when read;
- and, below the tree, an optional directory shared with other vLLM instances (`shared.py`,
  `shared`): after the tree's longest prefix a request's match goes on there block by block
  (by vLLM's full block hashes, `hashes`), those blocks are loaded straight into vLLM's paged
  cache (`Plan.shared_loads`), and every block a request computes is written there once
  (`Plan.shared_saves`). Local cache management does not see this tier.

Invariants:
- block keys are vLLM's chained block hashes (as ints), so a key names a whole prefix;
- the worker executes each step's `Plan` in order: tier moves, then loads (before the forward),
  then saves (after it). A node whose save is in the current plan stays locked until the next
  plan is built, so it is never moved or dropped before its data exists;
- a running request holds a lock on its cached path (vLLM holds those blocks too);
- a failed load leaves no wrong KV behind: the worker saves no block at or after a failed one
  in any request using it (`plan.tainted` over `Plan.chains`), and `load_failed` marks those
  keys `owed` (the tree holds them, the worker may not). An owed key is never matched (no
  request is told to load it), and the next request that computes it plans its save (and
  shared save) again, which clears it. `owed` only holds keys the tree holds;
- every tier change the tree records becomes a worker op (`plan.PlanOps` is the tree's `Storage`);
- a policy hook that raises never reaches vLLM (it would fail every request): the shadow logs
  it once, ranks by a fresh `fallback` policy (LRU) for the rest of its life, runs the hook
  again on it, and counts it in `Stats.policy_fallbacks` (`pbkv.engine.base.replace_policy`,
  as a pbkv server does).
Requests without hints are workflows of their own (see `hints.py`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pbkv.cache import Capacities, Node, RadixTree, Tier, TieredCache
from pbkv.engine.base import replace_policy
from pbkv.integrations.vllm.hints import Hints
from pbkv.integrations.vllm.plan import Plan, PlanOps, Stats
from pbkv.policy import CallEvent, PolicyContext, PrefetchRequest, make_policy
from pbkv.policy.lru import LRUPolicy


@dataclass
class _Req:
    keys: list[int]
    workflow: int
    hints: Hints
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    locked: Node | None = None
    load: tuple[int, int] | None = None    # (first block, blocks) to load at the next plan
    load_kinds: list[str] = field(default_factory=list)   # the Stats counter each load was counted in
    counted: bool = False
    hashes: list | None = None             # vLLM's full block hashes (with a shared tier)
    shared: tuple[int, int] = (0, 0)       # (first block, blocks) the shared tier holds after the match
    shared_load: tuple[int, int] | None = None
    shared_saved: int = 0                  # leading blocks already in the shared tier or handed to it


class Shadow:
    """pbkv's cache spine for one vLLM scheduler. See the module docstring.

    `fallback`: the policy factory that replaces one whose hook raised (None: the error
    propagates, as a test may want). Invariant: every policy event hook runs through `_hook`."""

    def __init__(self, block_size: int, capacities: Capacities, policy: str = "lru",
                 predictors: dict | None = None, clock=time.monotonic, shared=None, fallback=LRUPolicy,
                 agent_graph: dict | None = None, static_sequence: list | None = None):
        self.block_size = block_size
        self.fallback = fallback
        self.shared = shared    # a `shared.SharedBlocks` over every rank's files, or None
        self.clock = clock
        ctx = PolicyContext(block_size=block_size, predictors=predictors or {},   # the graph: kvflow's
                            agent_graph={a: list(n) for a, n in (agent_graph or {}).items()},
                            static_sequence=list(static_sequence) if static_sequence else None)
        self.policy = make_policy(policy, ctx)
        self.ops = PlanOps(lambda: self.plan)
        self.owed: set[int] = set()              # keys whose worker copy is missing or wrong
        self.ops.on_drop = self.owed.difference_update
        # per recent plan: its chains as (block ids, keys) and its loads as {block id: the Stats
        # counter it was counted in}; the request may be gone when its failed loads are
        # reported, and with async scheduling one more plan may be built before that
        self._chains: deque[tuple[list, dict[int, str]]] = deque(maxlen=2)
        self._loaded: dict[int, str] = {}
        self.cache = TieredCache(RadixTree(block_size), capacities, self.policy, storage=self.ops)
        self.tree = self.cache.tree
        self.policy.bind(self.cache, clock)
        self.plan = Plan()
        self.stats = Stats()
        self.reqs: dict[str, _Req] = {}
        self.workflows: dict[str, int] = {}     # workflow_id -> tree workflow number
        self._steps: dict[int, int] = {}
        self._next_wf = 0
        self._pending: list[Node] = []           # locked until the next plan (saves in flight)
        self._ending: set[int] = set()           # workflows marked done while a call still ran

    # ------------------------------------------------------------------ vLLM scheduler calls

    def match(self, req_id: str, keys: list[int], prompt_tokens: int, local_tokens: int,
              hints: Hints, hashes: list | None = None) -> int:
        """Tokens beyond vLLM's own `local_tokens` hit that the connector can load: the tree's,
        then the shared tier's (given `hashes`, vLLM's full block hashes).

        Only whole blocks, and never the last prompt token (vLLM must compute at least one)."""
        usable = min(len(keys), (prompt_tokens - 1) // self.block_size)
        if req_id not in self.reqs:
            self._start(req_id, keys, prompt_tokens, hints)
        st = self.reqs[req_id]
        st.keys, st.hashes = keys, hashes
        _, matched = self.tree.match(keys[:usable])
        if self.owed:
            matched = next((i for i in range(matched) if keys[i] in self.owed), matched)
        local = local_tokens // self.block_size
        end = max(matched, local)
        st.shared = (end, 0)
        if self.shared is not None and hashes is not None and end < usable:
            st.shared = (end, self.shared.prefix(hashes[end:usable]))
        return (end + st.shared[1] - local) * self.block_size

    def allocated(self, req_id: str, local_tokens: int, external_tokens: int) -> None:
        """vLLM allocated blocks: `external_tokens` will be loaded after `local_tokens`."""
        st = self.reqs[req_id]
        first, n = local_tokens // self.block_size, external_tokens // self.block_size
        start, held = st.shared
        shared = max(0, min(first + n, start + held) - max(first, start))
        n -= shared
        st.shared_load = (first + n, shared) if shared else None
        st.shared_saved = max(st.shared_saved, first + n + shared)
        if not st.counted:
            st.counted = True
            s = self.stats
            s.requests += 1
            s.prompt_tokens += st.prompt_tokens
            s.gpu_hit_tokens += local_tokens
            s.shared_hit_tokens += shared * self.block_size
        if n <= 0:
            return
        node, _ = self.tree.match(st.keys[:first + n])
        self._lock(st, node)
        st.load_kinds = []
        for path_node in node.path():
            lo, hi = max(path_node.start, first), min(path_node.end, first + n)
            if hi > lo:
                kind = "disk_hit_tokens" if path_node.tier == Tier.DISK else "host_hit_tokens"
                setattr(self.stats, kind, getattr(self.stats, kind) + (hi - lo) * self.block_size)
                st.load_kinds += [kind] * (hi - lo)
        self._promote(node)
        st.load = (first, n)

    def build(self, scheduled: list[tuple[str, list[int] | None, bool, int]]) -> Plan:
        """The plan of one step. `scheduled`: (req id, new block ids or None, replace them?,
        tokens computed once this step ran)."""
        for node in self._pending:
            self.tree.unlock(node)
        self._pending = []
        for req_id, block_ids, replace, computed in scheduled:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            if block_ids is not None:
                st.block_ids = list(block_ids) if replace else st.block_ids + list(block_ids)
            if st.load is not None:
                first, n = st.load
                self.plan.loads.extend((st.keys[i], st.block_ids[i]) for i in range(first, first + n))
                self._loaded.update(zip(st.block_ids[first:first + n], st.load_kinds))
                st.load = None
            if st.shared_load is not None:
                first, n = st.shared_load
                self.plan.shared_loads.extend((st.hashes[i], st.block_ids[i]) for i in range(first, first + n))
                self._loaded.update((st.block_ids[i], "shared_hit_tokens") for i in range(first, first + n))
                st.shared_load = None
            st.computed = computed
            self._save(st)
        self._chain(scheduled)
        plan, self.plan = self.plan, Plan()
        return plan

    def load_failed(self, block_ids: set[int]) -> None:
        """vLLM reports the loads of `block_ids` failed (in a recent plan): mark owed the keys
        at and after each failed block of every chain holding one (see the module docstring).
        Every later key of the request counts, not only those it had blocks for in that plan:
        with async scheduling its next chunk may have been computed from the bad block too."""
        self.stats.load_failed_blocks += len(block_ids)
        index = self.tree.index
        for chains, loaded in self._chains:
            for ids, keys in chains:
                first = next((i for i, b in enumerate(ids) if b in block_ids), None)
                if first is not None:
                    self.owed.update(k for k in keys[first:] if k in index)
                    self._unserved(ids[first:], loaded)

    def _unserved(self, block_ids: list[int], loaded: dict[int, str]) -> None:
        """Take back the hits counted for loads vLLM recomputed (a failed one and every one after
        it in its request), so `Stats.computed_tokens` counts them; each load once (popped)."""
        for b in block_ids:
            kind = loaded.pop(b, None)
            if kind is not None:
                setattr(self.stats, kind, getattr(self.stats, kind) - self.block_size)

    def finished(self, req_id: str) -> None:
        """A request finished (or was aborted): release its path, record the use, maybe end
        its workflow, offer the policy a prefetch (disk -> RAM)."""
        st = self.reqs.pop(req_id, None)
        if st is None:
            return
        now = self.clock()
        node = st.locked
        if node is not None:
            self.tree.touch(node, now, st.workflow, st.hints.agent)
            self.tree.unlock(node)
            for n in node.path():
                self.cache.refresh(n)
        event = CallEvent(st.workflow, st.hints.agent, self._steps.get(st.workflow, 0), None,
                          node or self.tree.root, now)
        self._hook("on_call_end", event)
        if st.hints.done or st.workflow in self._ending:
            self._end(st)
        self._prefetch(now)

    # ------------------------------------------------------------------ internals

    def _hook(self, name: str, *args):
        """The policy's hook `name` on `args`; if it raises (and `fallback` is set), the policy
        is replaced and the hook runs again on the new one."""
        try:
            return getattr(self.policy, name)(*args)
        except Exception:
            if self.fallback is None:
                raise
            self._fall_back(name)
        return getattr(self.policy, name)(*args)   # outside the except: a second error is not chained to the first

    def _fall_back(self, hook: str) -> None:
        """Called from an `except` block. The failed policy is never asked again, so it is
        replaced (and counted) once; the re-run on the fallback is not guarded: its error propagates."""
        self.policy = replace_policy(self.cache, self.policy, self.fallback, self.clock, hook)
        self.stats.policy_fallbacks += 1

    def _start(self, req_id: str, keys: list[int], prompt_tokens: int, hints: Hints) -> None:
        wf = self.workflows.get(hints.workflow_id) if hints.hinted else None
        if wf is None:
            wf = self._next_wf
            self._next_wf += 1
            if hints.hinted:
                self.workflows[hints.workflow_id] = wf
            self._hook("on_workflow_start", wf, hints.workflow_id or f"request-{req_id}")
        st = self.reqs[req_id] = _Req(keys, wf, hints, prompt_tokens)
        step = self._steps[wf] = self._steps.get(wf, -1) + 1
        node, _ = self.tree.match(keys)
        self._hook("on_call_start", CallEvent(wf, hints.agent, step, None, node, self.clock()))
        st.counted = False

    def _end(self, st: _Req) -> None:
        if any(o.workflow == st.workflow for o in self.reqs.values()):
            self._ending.add(st.workflow)   # another call of it still runs: end after the last
            return
        self._ending.discard(st.workflow)
        nodes = self.cache.end_workflow(st.workflow)
        self._hook("on_workflow_end", st.workflow, nodes)
        self._steps.pop(st.workflow, None)
        if st.hints.hinted:
            self.workflows.pop(st.hints.workflow_id, None)

    def _lock(self, st: _Req, node: Node) -> None:
        if node is st.locked or node is self.tree.root:
            return
        self.tree.lock(node)
        if st.locked is not None:
            self.tree.unlock(st.locked)
        st.locked = node

    def _promote(self, node: Node) -> None:
        """Loaded blocks are now in vLLM's GPU cache: move their nodes to DEVICE if room."""
        path = [n for n in node.path() if n.tier != Tier.DEVICE]
        if path:
            move = self.cache.prepare_load(path, Tier.DEVICE, keep_lock=False)
            if move is not None:
                self.cache.complete(move)

    def _chain(self, scheduled) -> None:
        """Put in the plan the block ids of every request using a block loaded in it (none
        without loads: no cost then), and remember them with the request's keys."""
        loaded, self._loaded = self._loaded, {}
        chains = []
        if loaded:
            for req_id, *_ in scheduled:
                st = self.reqs.get(req_id)
                if st is not None and not loaded.keys().isdisjoint(st.block_ids):
                    chains.append((list(st.block_ids), st.keys))
            self.plan.chains = [ids for ids, _ in chains]
        self._chains.append((chains, loaded))

    def _resave(self, st: _Req, full: int) -> None:
        """Plan again the saves of the owed keys among the request's first `full` (computed)
        blocks, and their shared saves; the saved nodes stay locked until the next plan."""
        owed = [i for i in range(full) if st.keys[i] in self.owed]
        if not owed:
            return
        st.shared_saved = min(st.shared_saved, owed[0])
        index = self.tree.index
        for i in owed:
            key = st.keys[i]
            self.owed.discard(key)
            self.plan.saves.append((key, st.block_ids[i]))
            self.tree.lock(index[key])
            self._pending.append(index[key])

    def _save(self, st: _Req) -> None:
        """Insert the request's newly complete prompt blocks and plan their saves."""
        full = min(st.computed, st.prompt_tokens, len(st.block_ids) * self.block_size) // self.block_size
        full = min(full, len(st.keys))
        if full <= 0:
            return
        if self.owed:
            self._resave(st, full)
        if self.shared is not None and st.hashes is not None and full > st.shared_saved:
            self.plan.shared_saves.extend((st.hashes[i], st.block_ids[i]) for i in range(st.shared_saved, full))
            st.shared_saved = full
        node, matched = self.tree.match(st.keys[:full])
        if matched:
            self._promote(node)   # the prefix is in vLLM's GPU memory now, used by this request
            if node.tier != Tier.DEVICE:
                return            # no room to model it there: new blocks cannot hang below
            self._lock(st, node)  # before `reserve`: making room must not evict the prefix
        if matched < full:
            tokens = (full - matched) * self.block_size
            if not self.cache.reserve(tokens):
                return   # everything pinned: these blocks stay uncached by the connector
            node, added = self.cache.insert(st.keys[:full], self.block_size, self.clock())
            self.cache.release(tokens - added)
            self.plan.saves.extend((st.keys[i], st.block_ids[i]) for i in range(matched, full))
            self.stats.saved_tokens += tokens
            self.tree.lock(node)
            self._pending.append(node)
        self._lock(st, node)

    def _prefetch(self, now: float) -> None:
        free = self.cache.free(Tier.HOST)
        if free <= 0:
            return
        for node in self._hook("prefetch", PrefetchRequest(free, free, now)):
            path = [n for n in node.path() if n.tier == Tier.DISK]
            if not path or not node.alive:
                continue
            move = self.cache.prepare_load(path, Tier.HOST, keep_lock=False, allow_evict=False)
            if move is None:
                break
            self.cache.complete(move)
