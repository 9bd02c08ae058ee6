"""The real engine's cache side: admitting a request, loads and prefetches, inserting new KV.

Mixed into `HFEngine` (engine.py), which holds `cache`, `tree`, `store`, `policy`, `rates`,
`clock`, `opts`, `stats`, `_waiting`, `_transfers` and `_inflight` (and `_limit`, execute.py;
`_timed`, the `_waiting` list and `_unpin_waiting` come from `pbkv.engine.base.EngineBase`).
All tree and cache updates run on the engine's thread; the worker thread only copies tensors and
reads and writes files.

Admission of a request whose longest cached prefix reaches into host or disk (`_admit`):
- load rule (`opts.load_rule`): "auto" loads when the estimated load time (bytes over the
  measured bandwidth of each source tier, plus a fixed latency) is at most the estimated time to
  recompute those tokens (tokens over the measured prefill rate); "load" always loads, and
  "recompute" never does. A load is a two-phase move: `prepare_load` pins the nodes and reserves
  device space, the worker reads them, and the engine completes the move when it is done (the
  request waits; others run);
- a prefix that is already in flight (another request's load, a prefetch) is waited for when
  its remaining estimated time is at most the recompute estimate ("load": always), else
  recomputed. A node in flight is never split: a request that diverges inside one waits;
- recomputed prefix nodes are promoted to the device with the freshly computed KV (a move whose
  data comes from the prefill), so new blocks can hang below them; with no room for that, the
  request still runs and its new blocks are simply not cached;
- a node whose data proved unreadable (`lost`) ends the usable prefix and is dropped from the
  tree (with its subtree, whose KV is useless without it) as soon as nothing pins it; so is a
  node whose disk write failed, from the next step after the failure (`drop_failed_writes`): no
  load is tried for it, and the disk space it was counted in is free again;
- a request's load is aborted when the request is cancelled (`_abort_load`): the move's space
  and pin go back at once, and whatever the worker still reads for it is discarded unread;
- with a shared tier (`shared.py`), an admitted request whose local prefix is on the device and
  not promoted continues its match in the shared directory from there (after its space is
  reserved: a blocked request reads nothing); those tokens are counted as "shared" hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pbkv.cache import Move, Node, Tier
from pbkv.engine.base import tokens_by_tier
from pbkv.engine.hf.transfer import Transfer, load_task
from pbkv.engine.prefetch import prepare_prefetches
from pbkv.engine.request import Request
from pbkv.policy import PrefetchRequest

ADMITTED, LOADING, WAIT, BLOCKED = "admitted", "loading", "wait", "blocked"


@dataclass(eq=False)
class Admission:
    """What prefill needs: the device path to gather, how many tokens to reuse, a promotion."""

    req: Request
    path: list[Node]          # device nodes, root side first
    cached: int               # prompt tokens whose KV is reused: from `path`, then from `shared`
    promote: Move | None = None
    shared: torch.Tensor | None = None   # KV read from the shared tier, right after `path`'s
    keys: list[int] | None = None        # the prompt's shared-tier keys, when already computed


class CacheOps:
    # ------------------------------------------------------------------ admission

    def _admit(self, req: Request) -> tuple[str, Admission | None]:
        call = req.call
        path = self._usable_path(req)
        if path is None:
            return self._wait(req), None
        cap = call.input_length - 1  # the last prompt token is always computed (its logits)
        first = next((i for i, n in enumerate(path) if n.tier != Tier.DEVICE), len(path))
        device = sum(n.tokens for n in path[:first])
        promote, recomputing = None, first < len(path)
        if recomputing:
            status, promote = self._load_or_recompute(req, path[first:], device, cap)
            if status is not None:
                return status, None
            if promote is None:
                path = path[:first]
        cached = min(device, cap)
        held = min(sum(n.tokens for n in path) if promote else device, call.input_length)
        need = call.input_length - held + self._limit(req)
        pin = path[-1] if path else None
        if pin is not None and promote is None:
            self.tree.lock(pin)
        if not self.cache.reserve(need):
            if promote is not None:
                self.cache.abort(promote)
            elif pin is not None:
                self.tree.unlock(pin)
            return BLOCKED, None
        shared, keys = self._read_shared(req, cached, cap) if promote is None else (None, None)
        req.count_hits(cached, 0 if shared is None else shared.shape[3])
        if recomputing:
            self.stats.recompute_instead_of_load += 1
        if req.node is not None:  # the pin its completed load held
            self.tree.unlock(req.node)
        req.node, req.reserved, req.cached, req.admitted = pin, need, cached, self.clock.now()
        if pin is not None:
            self.tree.touch(pin, req.admitted, req.workflow, call.agent)
        return ADMITTED, Admission(req, path[:first], cached + (0 if shared is None else shared.shape[3]),
                                   promote, shared, keys)

    def _usable_path(self, req: Request) -> list[Node] | None:
        """The cached path of `req`'s prompt, root side first, cut before its first lost node;
        None when the prompt diverges inside a node in flight (never split: the request waits)."""
        node, matched = self.tree.match(req.call.hash_ids)
        if matched and node.end > matched:
            if node.id in self._inflight:
                return None
            node = self.tree.split(node, matched - node.start)
        path = node.path() if matched else []
        for i, n in enumerate(path):
            if self.store.is_lost(n):
                return path[:i]
        return path

    def _load_or_recompute(self, req: Request, lower: list[Node], device: int,
                           cap: int) -> tuple[str | None, Move | None]:
        """The prefix below the `device` tokens on the device is `lower` (host/disk): start its
        load (LOADING), wait for it (WAIT), or recompute it: (None, the promotion of `lower` to
        the device with its fresh KV, or None when there is no room for that)."""
        rule = self.opts.load_rule
        by_tier = tokens_by_tier(lower)
        recompute = self.rates.prefill_seconds(max(0, min(device + sum(by_tier), cap) - device))
        busy = [self._inflight[n.id] for n in lower if n.id in self._inflight]
        if busy:
            if rule == "load" or (rule == "auto" and max(t.eta for t in busy) - self.clock.now() <= recompute):
                return self._wait(req), None
        elif self.would_load(by_tier, recompute):
            move = self.cache.prepare_load(lower, keep_lock=True)
            if move is not None:
                over = max(0, device + sum(by_tier) - cap)
                by_tier[lower[-1].tier] -= over
                self._hold_load(req, move, by_tier)
                self._start_transfer(move, req)
                return LOADING, None
        if not busy and device + sum(by_tier) <= req.call.input_length:
            # recompute, keeping the result: room on the device for these nodes' fresh KV
            return None, self.cache.prepare_load(lower, keep_lock=True)
        return None, None

    def would_load(self, by_tier: list[int], recompute_s: float) -> bool:
        """The load rule for a prefix held below the device (`by_tier`: its tokens per tier):
        load it back (True) or recompute it (`recompute_s`: seconds to recompute it)."""
        rule = self.opts.load_rule
        return rule == "load" or (rule == "auto" and self.rates.load_seconds(by_tier) <= recompute_s)

    def _wait(self, req: Request) -> str:
        if id(req) not in self._waited:  # count each request once, however often it is polled
            self._waited.add(id(req))
            self.stats.load_waits += 1
        return WAIT

    # ------------------------------------------------------------------ insertion

    def _insert(self, req: Request, kv_of) -> None:
        """Cache the prompt's new blocks on the device and move the request's pin to its deepest
        node. `kv_of(start, end)` gives the prompt's KV for token positions [start, end)."""
        call, bs = req.call, self.tree.block_size
        node, m = self.tree.match(call.hash_ids)
        if m and (node.tier != Tier.DEVICE or self.store.is_lost(node)):
            return  # the prompt runs through uncached or lost nodes: nothing new can hang below
        if node.end == m and m < len(call.hash_ids) and m and node.tail_tokens != bs:
            return  # cannot extend a node whose last block is partial
        tail = call.input_length - bs * (len(call.hash_ids) - 1)
        leaf, added = self.cache.insert(call.hash_ids, tail, self.clock.now())
        if added:
            start = leaf.start * bs
            self.store.attach(leaf, kv_of(start, start + leaf.tokens))
        req.reserved -= added
        self.tree.lock(leaf)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = leaf

    # ------------------------------------------------------------------ transfers

    def _start_transfer(self, move: Move, req: Request | None) -> None:
        tokens = tokens_by_tier(move.nodes)
        entries = [(n.id, n.value) for n in move.nodes]
        future = self.store.worker.submit(load_task, self.store, entries)
        t = Transfer(move, future, self.clock.now() + self.rates.load_seconds(tokens), req, tokens)
        self._transfers.append(t)
        for n in move.nodes:
            self._inflight[n.id] = t

    def _poll_transfers(self, block: bool = False) -> None:
        self.drop_failed_writes()
        if block and self._transfers and not any(t.future.done() for t in self._transfers):
            self._transfers[0].future.exception()  # FIFO worker: the oldest finishes first (waits, never raises)
        for t in [t for t in self._transfers if t.future.done()]:
            self._finish_transfer(t)

    def _finish_transfer(self, t: Transfer) -> None:
        """Install a finished load, or give its space and pin back: an entry it could not read
        is lost (its request goes back to the queue and recomputes). When the worker's task
        itself raised (a failure of the engine, not of one entry's data) the move is given back
        too before the error leaves `step()`: nothing stays held for the server's life."""
        self._transfers.remove(t)
        for n in t.move.nodes:
            self._inflight.pop(n.id, None)
        if t.future.exception() is not None:
            self._give_back(t)
            t.future.result()   # raises
        res = t.future.result()
        for tier in (Tier.HOST, Tier.DISK):
            if t.tokens[tier] and not res.errors:
                self.rates.saw_load(tier, res.bytes_by_tier[tier], res.seconds * t.tokens[tier] / sum(t.tokens))
        req = t.req
        if res.errors:
            self._give_back(t)
            for n in t.move.nodes:
                if n.id in res.errors:
                    self.store.mark_lost(n)
                    self._lost.add(n)
            self._discard_lost()
            self.stats.failed_loads += 1
            return
        for n in t.move.nodes:
            self.store.stage(n, res.tensors[n.id])
        self.cache.complete(t.move)
        self.stats.loaded_tokens[Tier.HOST] += t.tokens[Tier.HOST]
        self.stats.loaded_tokens[Tier.DISK] += t.tokens[Tier.DISK]
        if req is not None:
            req.move, req.loading = None, False

    def _give_back(self, t: Transfer) -> None:
        """A load that did not arrive: release its space and pin; its request (if any) goes back
        to the queue, to be matched again."""
        self.cache.abort(t.move)   # the move's pin was the request's (req.node): not unlocked twice
        req = t.req
        if req is not None:
            req.move, req.loading, req.node, req.loaded = None, False, None, (0, 0)

    def _abort_load(self, req: Request) -> None:
        """`req` (loading its prefix) was cancelled: give its move's space and pin back now."""
        t = next(t for t in self._transfers if t.req is req)
        self._transfers.remove(t)
        for n in t.move.nodes:
            self._inflight.pop(n.id, None)
        self._give_back(t)

    def drop_failed_writes(self) -> None:
        """Drop the nodes whose disk write failed (the worker thread only sets `DiskFile.error`).
        Every step does this first; a reader of the cache's usage between steps may too."""
        failed = self.store.failed_writes()
        if failed:
            for n in failed:
                self.store.mark_lost(n)
                self._lost.add(n)
            self._discard_lost()

    def _discard_lost(self) -> None:
        for n in list(self._lost):
            if not n.alive or self.cache.discard(n):
                self._lost.discard(n)

    def _prefetch(self) -> None:
        """A decode-only step with the link idle: offer the policy what the link moves meanwhile."""
        if not self.opts.prefetch or self._transfers:
            return
        budget = self.rates.prefetch_budget()
        wanted = self._timed(self.policy.prefetch,
                             PrefetchRequest(budget, self.cache.free(Tier.DEVICE), self.clock.now()))
        for move, tokens in prepare_prefetches(self.cache, wanted, budget, self.policy.allow_evict_for_prefetch,
                                               lambda n: n.id in self._inflight or self.store.is_lost(n),
                                               lambda n: self._timed(self.policy.prefetch_floor, n)):
            self.stats.prefetched_tokens += tokens
            self._start_transfer(move, None)
