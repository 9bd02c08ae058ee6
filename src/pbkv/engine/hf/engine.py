"""The real engine: a transformers causal LM serving calls over the shared radix cache.

Same driver API as the simulator (`now`, `at`, `start_workflow`, `end_workflow`, `submit`,
`run`), same `TieredCache` and `Policy` objects; only the cost of an operation is real. The
loop, in order of priority: fire due events (the driver's submits), install finished loads,
prefill one admissible request (FCFS; prefill has priority, as in SGLang), else one decode step
of every running request (sequentially: no padding, so outputs are exactly a lone request's),
offering the policy a prefetch first when the link is idle; with nothing to run it waits for a
load, or skips the clock to the next event (tool waits are skipped, not slept).

Per request: the prompt (trace block ids -> token ids, `tokens.py`) is matched in the tree;
the reused prefix's KV is gathered from the device nodes (no recompute), only the rest is
prefilled, its new full blocks (and partial tail) become a device node with its own KV, and the
final hidden state of the last prompt token goes to the policy (`on_prefill`, `on_call_end`:
`CallEvent.hidden`). The last prompt token is always computed (its logits pick the first output
token). Host/disk prefixes are loaded or recomputed: see `admit.py`.

Invariants: a node's KV lives in its tier (`kvstore.py`); device tokens in use = tree nodes +
what running requests reserved (prompt suffix + outputs), as in the simulator. Each running
request also holds a private working copy of its whole context (not paged): real memory can
reach about twice the accounted device tokens.
"""

from __future__ import annotations

import heapq
import time
import zlib
from typing import Callable

import torch

from pbkv.cache import Tier, TieredCache
from pbkv.engine.hf.admit import ADMITTED, BLOCKED, Admission, CacheOps
from pbkv.engine.hf.kvstore import KVStore
from pbkv.engine.hf.model import LoadedModel, cache_to_kv, forward, make_cache
from pbkv.engine.hf.tokens import TokenMapper, block_hashes
from pbkv.engine.hf.state import LOAD_RULES, EngineOptions, EngineStats, Output, Seq  # noqa: F401 (re-exported)
from pbkv.engine.hf.transfer import Rates, WallClock, Worker
from pbkv.engine.request import Request
from pbkv.policy import CallEvent, Policy
from pbkv.trace import Call

class EngineError(RuntimeError):
    pass


class HFEngine(CacheOps):
    def __init__(self, lm: LoadedModel, cache: TieredCache, policy: Policy,
                 tokenize: Callable[[Call], list[int]] | None = None, clock=None, worker: Worker | None = None,
                 options: EngineOptions | None = None, disk_dir=None):
        self.lm, self.cache, self.tree, self.policy = lm, cache, cache.tree, policy
        self.opts = options or EngineOptions()
        self.clock = clock or WallClock()
        self.store = KVStore(lm.device, worker or Worker(), disk_dir)
        cache.storage = self.store
        self.tokenize = tokenize or TokenMapper(lm.vocab_size, self.tree.block_size, self.opts.seed).tokens
        self.rates = Rates(lm.kv_bytes_per_token)
        self.stats = EngineStats()
        self.waiting: list[Request] = []
        self.running: list[Seq] = []
        self._events: list = []
        self._seq = 0
        self._transfers: list = []
        self._inflight: dict = {}       # node id -> Transfer moving it up
        self._lost: set = set()         # nodes with unreadable data, dropped once unpinned
        self._waited: set = set()
        self._prompts: dict[int, list[int]] = {}   # id(call) -> explicit token ids (generate)
        policy.bind(cache, self.clock.now)

    # ------------------------------------------------------------------ driver API

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, when: float, fn) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, fn))

    def start_workflow(self, workflow: int, workflow_id: str) -> None:
        self._timed(self.policy.on_workflow_start, workflow, workflow_id)

    def end_workflow(self, workflow: int) -> None:
        nodes = self.cache.end_workflow(workflow)
        self._timed(self.policy.on_workflow_end, workflow, nodes)

    def submit(self, req: Request) -> None:
        req.arrival = self.clock.now()
        node, _ = self.tree.match(req.call.hash_ids)
        self._timed(self.policy.on_call_start, self._event(req, node))
        self.waiting.append(req)

    def generate(self, token_ids: list[int], max_new_tokens: int, workflow: int | None = None,
                 agent: str = "user") -> Output:
        """Serve one prompt given as token ids to completion (no driver needed)."""
        if not token_ids:
            raise ValueError("empty prompt")
        call = Call(f"generate-{self._seq}", 0, agent, len(token_ids), max_new_tokens,
                    block_hashes(list(token_ids), self.tree.block_size))
        self._prompts[id(call)] = list(token_ids)
        own = workflow is None
        workflow = -1 - self._seq if own else workflow
        if own:
            self.start_workflow(workflow, call.workflow_id)
        req = Request(call=call, workflow=workflow, on_done=lambda r: None)
        self.submit(req)
        self.run()
        if own:
            self.end_workflow(workflow)
        self._prompts.pop(id(call), None)
        return req.result

    def run(self) -> None:
        """Serve until no request, event or transfer is left."""
        while True:
            self._fire_events()
            self._poll_transfers()
            if self.waiting and self._prefill_next():
                continue
            if self.running:
                self._prefetch()
                self._decode_step()
            elif self._transfers:
                self._poll_transfers(block=True)
            elif self._events:
                self.clock.skip_to(self._events[0][0])
            elif self.waiting and self._unpin_waiting():
                continue
            elif self.waiting:
                call = self.waiting[0].call
                raise EngineError(f"stuck: call {call.workflow_id} step {call.step} needs "
                                  f"{call.input_length + call.output_length} device tokens; capacity "
                                  f"{self.cache.capacity.device}, evictable {self.cache.evictable(Tier.DEVICE)}")
            else:
                return

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ scheduling

    def _fire_events(self) -> None:
        while self._events and self._events[0][0] <= self.clock.now():
            heapq.heappop(self._events)[2]()

    def _prefill_next(self) -> bool:
        for req in list(self.waiting):
            if req.loading:
                continue
            if len(self.running) >= self.opts.max_running:
                return False
            status, adm = self._admit(req)
            if status == BLOCKED:
                return False
            if status == ADMITTED:
                self.waiting.remove(req)
                self._prefill(adm)
                return True
        return False

    def _prefill(self, adm: Admission) -> None:
        req, call = adm.req, adm.req.call
        tokens = self._prompts.get(id(call)) or self.tokenize(call)
        if len(tokens) != call.input_length:
            raise EngineError(f"call {call.workflow_id} step {call.step}: {len(tokens)} token ids for "
                              f"input_length {call.input_length}")
        start = time.perf_counter()
        past = self.store.gather(adm.path, adm.cached)
        logits, hidden, kv = forward(self.lm, tokens[adm.cached:], make_cache(past))
        seconds = time.perf_counter() - start
        computed = call.input_length - adm.cached
        self.stats.prefills += 1
        self.stats.prefill_seconds += seconds
        self.stats.computed_tokens += computed
        self.rates.saw_prefill(computed, seconds)

        def kv_of(a: int, b: int) -> torch.Tensor:
            return cache_to_kv(kv, a, b)
        if adm.promote is not None:  # recomputed host/disk nodes take the fresh KV to the device
            for n in adm.promote.nodes:
                self.store.stage(n, kv_of(n.start * self.tree.block_size, n.start * self.tree.block_size + n.tokens))
            self.cache.complete(adm.promote)
        self._insert(req, kv_of)
        req.first_token = self.clock.now()
        req.result = Output([], hidden.cpu().numpy(), adm.cached)
        self._timed(self.policy.on_prefill, self._event(req, req.node))
        if call.output_length <= 0:
            self._finish(req)
            return
        gen = None
        if self.opts.temperature > 0:
            key = f"{self.opts.seed}|{call.workflow_id}|{call.step}".encode()
            gen = torch.Generator(device=self.lm.device).manual_seed(zlib.crc32(key))
        seq = Seq(req, kv, call.output_length - 1, gen)
        self._emit(seq, logits)
        if seq.remaining == 0:
            self._finish(req)
        else:
            self.running.append(seq)

    def _decode_step(self) -> None:
        start = time.perf_counter()
        for seq in list(self.running):
            logits, _, seq.cache = forward(self.lm, [seq.req.result.tokens[-1]], seq.cache)
            self._emit(seq, logits)
            seq.remaining -= 1
            if seq.remaining == 0:
                self.running.remove(seq)
                self._finish(seq.req)
        seconds = time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_seconds += seconds
        self.rates.saw_decode(seconds)

    def _emit(self, seq: Seq, logits: torch.Tensor) -> None:
        out: Output = seq.req.result
        if seq.gen is None:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / self.opts.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=seq.gen))
        out.tokens.append(token)
        if self.opts.record_logits:
            out.logits.append(logits.detach().cpu().clone())

    def _finish(self, req: Request) -> None:
        req.finished = self.clock.now()
        self.cache.release(req.reserved)
        req.reserved = 0
        if req.node is not None:
            self.tree.touch(req.node, req.finished, req.workflow, req.call.agent)  # recency = end of use
            self.tree.unlock(req.node)
        self._timed(self.policy.on_call_end, self._event(req, req.node))
        self._waited.discard(id(req))
        if self._lost:
            self._discard_lost()
        req.on_done(req)

    # ------------------------------------------------------------------ helpers

    def _timed(self, hook, *args):
        start = time.perf_counter()
        out = hook(*args)
        self.stats.policy_calls += 1
        self.stats.policy_seconds += time.perf_counter() - start
        return out

    def _event(self, req: Request, node) -> CallEvent:
        call, out = req.call, req.result
        return CallEvent(req.workflow, call.agent, call.step, call, node or self.tree.root, self.clock.now(),
                         hidden=out.hidden if isinstance(out, Output) else None)
