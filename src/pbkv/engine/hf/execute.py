"""The real engine's compute side: prefill one admitted request, decode one step, end a request.

Mixed into `HFEngine` (engine.py), which holds `lm`, `cache`, `tree`, `store`, `policy`,
`rates`, `clock`, `opts`, `stats`, `_waiting`, `_running` and `_prompts` (`_timed` and `_event`:
`pbkv.engine.base.EngineBase`). Everything runs on the engine's thread.

Invariants:
- a request is in exactly one of: the waiting list, the running list (as a `Seq`), finished
  (`finish_reason` set). `_finish` is the only way out, runs once per request, releases its
  reservation and its pin, tells the policy (`on_call_end`) and then calls `on_done`;
- a `Seq` is in the running list before its first token is emitted, so a callback
  (`on_token`, `on_done`) may cancel any request, itself included, at any point: the loops
  below skip requests that finished while they ran;
- sequences decode one after another (no padding): a request's outputs are exactly those of
  the same request served alone;
- failures are isolated per request: an exception raised by one request's own work (its
  prefill forward, its sampling, its `on_token` callback, its decode forward) ends THAT request
  with "error" (`Request.error` says why) and frees what it holds, as any end does; the other
  requests go on, unchanged. Only failures of shared state (the cache, the policy) leave `step()`.
"""

from __future__ import annotations

import time
import zlib

import torch

from pbkv.engine.hf.admit import ADMITTED, BLOCKED, Admission
from pbkv.engine.hf.model import cache_to_kv, forward, make_cache
from pbkv.engine.hf.sampling import sample
from pbkv.engine.hf.state import EngineError, Output, Seq
from pbkv.engine.request import Request
from pbkv.engine.sampling import DEFAULT, ERROR, LENGTH, STOP

SEED_RANGE = 2**63   # torch.Generator.manual_seed takes 64-bit seeds: any integer maps into [0, 2**63)


class ExecOps:
    def _limit(self, req: Request) -> int:
        """Output tokens `req` may produce (and has device space reserved for)."""
        s = req.sampling
        return req.call.output_length if s is None or s.max_new_tokens is None else s.max_new_tokens

    def _prefill_next(self) -> bool:
        """Admit and prefill the first admissible waiting request (FCFS, loads skipped); whether
        one ran. Stops at the first request that cannot get device space (no overtaking), and
        then sets `_blocked`."""
        self._blocked = False
        for req in list(self._waiting):
            if req.loading:
                continue
            if len(self._running) >= self.opts.max_running:
                return False
            status, adm = self._admit(req)
            if status == BLOCKED:
                self._blocked = True
                return False
            if status == ADMITTED:
                self._waiting.remove(req)
                self._prefill(adm)
                return True
        return False

    def _prefill(self, adm: Admission) -> None:
        req, call = adm.req, adm.req.call
        tokens = self._prompts.get(id(req)) or self.tokenize(call)
        if len(tokens) != call.input_length:
            raise EngineError(f"call {call.workflow_id} step {call.step}: {len(tokens)} token ids for "
                              f"input_length {call.input_length}")
        start = time.perf_counter()
        past = self.store.gather(adm.path, adm.cached - (0 if adm.shared is None else adm.shared.shape[3]))
        if adm.shared is not None:
            past = adm.shared if past is None else torch.cat([past, adm.shared], dim=3)
        try:
            logits, hidden, kv = forward(self.lm, tokens[adm.cached:], make_cache(past))
        except Exception as e:  # noqa: BLE001 - this request's own computation: it alone ends
            if adm.promote is not None:    # the move held the pin; nothing was promoted
                self.cache.abort(adm.promote)
                req.node = None
            self._fail(req, e)
            return
        seconds = time.perf_counter() - start
        computed = call.input_length - adm.cached
        self.stats.prefills += 1
        self.stats.prefill_seconds += seconds
        self.stats.computed_tokens += computed
        self.rates.saw_prefill(computed, seconds)
        self._write_shared(tokens, adm.cached, kv, adm.keys)

        def kv_of(a: int, b: int) -> torch.Tensor:
            return cache_to_kv(kv, a, b)
        if adm.promote is not None:  # recomputed host/disk nodes take the fresh KV to the device
            bs = self.tree.block_size
            for n in adm.promote.nodes:
                self.store.stage(n, kv_of(n.start * bs, n.start * bs + n.tokens))
            self.cache.complete(adm.promote, loaded=False)   # nothing was read: not a load
        self._insert(req, kv_of)
        req.first_token = self.clock.now()
        req.result = Output([], hidden.cpu().numpy(), adm.cached)
        self._timed(self.policy.on_prefill, self._event(req, req.node))
        limit = self._limit(req)
        if limit <= 0:
            self._finish(req, LENGTH)
            return
        try:
            seq = self._new_seq(req, kv, limit)
            self._running.append(seq)
            self._advance(seq, logits)
        except Exception as e:  # noqa: BLE001 - its sampling or on_token: it alone ends
            self._fail(req, e)

    def _new_seq(self, req: Request, kv, limit: int) -> Seq:
        s, call = req.sampling or DEFAULT, req.call
        temperature = self.opts.temperature if s.temperature is None else s.temperature
        gen = None
        if temperature > 0:
            seed = s.seed
            if seed is None:
                seed = zlib.crc32(f"{self.opts.seed}|{call.workflow_id}|{call.step}".encode())
            gen = torch.Generator(device=self.lm.device).manual_seed(seed % SEED_RANGE)
        stops = frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else frozenset(self.opts.eos_token_ids))
        return Seq(req, kv, gen, temperature, s.top_p, stops, limit)

    def _decode_step(self) -> None:
        """One new token for every running request, each after its own last token."""
        start = time.perf_counter()
        for seq in list(self._running):
            if seq.req.finish_reason is not None:  # cancelled by a callback earlier in this step
                continue
            try:
                logits, _, seq.cache = forward(self.lm, [seq.req.result.tokens[-1]], seq.cache)
                self._advance(seq, logits)
            except Exception as e:  # noqa: BLE001 - its decode, sampling or on_token: it alone ends
                self._fail(seq.req, e)
        seconds = time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_seconds += seconds
        self.rates.saw_decode(seconds)

    def _advance(self, seq: Seq, logits: torch.Tensor) -> None:
        """Emit one token of a running `seq`; finish it when that ended it."""
        reason = self._emit(seq, logits)
        if reason is not None and seq.req.finish_reason is None:  # not cancelled from on_token
            self._running.remove(seq)
            self._finish(seq.req, reason)

    def _emit(self, seq: Seq, logits: torch.Tensor) -> str | None:
        """Pick the next token; the reason the request ends with it, or None to go on."""
        req = seq.req
        out: Output = req.result
        token = sample(logits, seq.temperature, seq.top_p, seq.gen)
        if token in seq.stops:
            return STOP
        out.tokens.append(token)
        if self.opts.record_logits:
            out.logits.append(logits.detach().cpu().clone())
        if req.on_token is not None and req.on_token(req, token):
            return STOP
        return LENGTH if len(out.tokens) >= seq.limit else None

    def _fail(self, req: Request, exc: Exception) -> None:
        """End `req` alone with "error" after its own work raised `exc`; it may be waiting for
        nothing (mid-prefill), running, or already ended (its `on_done` raised: then `exc`
        propagates, since the request is answered and the failure is not its own work)."""
        if req.finish_reason is not None:
            raise exc
        req.error = f"{type(exc).__name__}: {exc}"
        seq = next((s for s in self._running if s.req is req), None)
        if seq is not None:
            self._running.remove(seq)
        self._finish(req, ERROR)

    def _finish(self, req: Request, reason: str) -> None:
        """End `req` (already out of the waiting and running lists): release what it holds."""
        req.finish_reason = reason
        req.finished = self.clock.now()
        self.cache.release(req.reserved)
        req.reserved = 0
        if req.node is not None:
            self.tree.touch(req.node, req.finished, req.workflow, req.call.agent)  # recency = end of use
            self.tree.unlock(req.node)
        self._prompts.pop(id(req), None)
        self._timed(self.policy.on_call_end, self._event(req, req.node))
        self._waited.discard(id(req))
        if self._lost:
            self._discard_lost()
        req.on_done(req)
