"""The real engine: a transformers causal LM serving calls over the shared radix cache.

Same driver API as the simulator (`now`, `at`, `start_workflow`, `end_workflow`, `submit`,
`run`), same `TieredCache` and `Policy` objects; only the cost of an operation is real.

Public step-wise API (what `run()` and the server use; nothing else needs the internals):
- `step()`: one scheduling iteration, in order of priority: fire due events (the driver's
  submits), install finished loads, prefill one admissible request (FCFS; prefill has priority,
  as in SGLang), else one decode step of every running request (sequentially: no padding, so
  outputs are exactly a lone request's), offering the policy a prefetch first when the link is
  idle; with nothing to run it waits for a load, or skips the clock to the next event (tool
  waits are skipped, not slept). Returns False only when nothing is left to do; raises `Stuck`
  (changing nothing) when the queue head can never fit. `run()` is `while step(): pass`;
- per request: `Request.sampling` (temperature, top_p, seed, stop token ids, max new tokens,
  ignore_eos) and `Request.on_token` (streaming; returns True to stop, e.g. at a stop string):
  see `pbkv.engine.sampling`. `Request.finish_reason` says why it ended; `submit(req, prompt_ids)`
  gives explicit token ids instead of the trace mapping (`tokenize`);
- `cancel(req)`: end a waiting, loading or running request now and free everything it holds;
- `busy`, `queue_depth`, `running_count`, `requests`, `stats`: read-only views for metrics;
  `drop_failed_writes()`: drop the entries whose disk write failed since the last step (each
  step does it first; a metrics reader calls it so that an idle engine's usage is current).
All of it must be called from one thread (the engine's); callbacks run on it, inside `step()`.

Per request: the prompt (trace block ids -> token ids, `tokens.py`) is matched in the tree;
the reused prefix's KV is gathered from the device nodes (no recompute), only the rest is
prefilled, its new full blocks (and partial tail) become a device node with its own KV, and the
final hidden state of the last prompt token goes to the policy (`on_prefill`, `on_call_end`:
`CallEvent.hidden`). The last prompt token is always computed (its logits pick the first output
token). Host/disk prefixes are loaded or recomputed: see `admit.py`; prefill, decode and the end
of a request: `execute.py`; with `shared_dir`, a directory shared with other engines continues
the local match and receives each prefill's computed blocks: `shared.py`; blocks another
replica sent for a call (`peer` inbox, `export_prefix` for the sender side): `peer.py`.

Invariants: a node's KV lives in its tier (`kvstore.py`); device tokens in use = tree nodes +
what live requests reserved (prompt suffix + max new tokens; pending loads), as in the
simulator; a finished or cancelled request holds no reservation, pin or transfer. Each running
request also holds a private working copy of its whole context (not paged): real memory can
reach about twice the accounted device tokens.
"""

from __future__ import annotations

from typing import Callable

from pbkv.cache import TieredCache
from pbkv.engine.base import EngineBase
from pbkv.engine.hf.admit import CacheOps
from pbkv.engine.hf.execute import ExecOps
from pbkv.engine.hf.kvstore import KVStore
from pbkv.engine.hf.model import LoadedModel
from pbkv.engine.hf.peer import PeerInbox, export_prefix
from pbkv.engine.hf.shared import SharedOps, SharedTier
from pbkv.engine.hf.state import (LOAD_RULES, EngineError, EngineOptions, EngineStats, Output, Seq,  # noqa: F401
                                  Stuck)
from pbkv.engine.hf.tokens import TokenMapper, block_hashes
from pbkv.engine.hf.transfer import Rates, WallClock, Worker
from pbkv.engine.request import Request
from pbkv.engine.sampling import CANCELLED, Sampling
from pbkv.policy import Policy
from pbkv.trace import DEFAULT_AGENT, Call


class HFEngine(ExecOps, CacheOps, SharedOps, EngineBase):
    def __init__(self, lm: LoadedModel, cache: TieredCache, policy: Policy,
                 tokenize: Callable[[Call], list[int]] | None = None, clock=None, worker: Worker | None = None,
                 options: EngineOptions | None = None, disk_dir=None, shared_dir=None,
                 shared_bytes: int | None = None):
        self.clock = clock or WallClock()
        super().__init__(cache, policy, EngineStats(), self.clock.now)
        self.lm = lm
        self.opts = options or EngineOptions()
        self.store = KVStore(lm.device, worker or Worker(), disk_dir)
        cache.storage = self.store
        self.shared = SharedTier(shared_dir, lm, self.tree.block_size, shared_bytes) if shared_dir else None
        self.peer = PeerInbox(self.tree.block_size, lm.device)   # KV other replicas sent (peer.py)
        self.tokenize = tokenize or TokenMapper(lm.vocab_size, self.tree.block_size, self.opts.seed).tokens
        self.rates = Rates(lm.kv_bytes_per_token)
        self._running: list[Seq] = []   # decoding (`_waiting`, FCFS, also holds requests whose prefix loads)
        self._transfers: list = []
        self._inflight: dict = {}       # node id -> Transfer moving it up
        self._lost: set = set()         # nodes with unreadable data, dropped once unpinned
        self._waited: set = set()
        self._prompts: dict[int, list[int]] = {}   # id(request) -> explicit token ids, until it ends

    # ------------------------------------------------------------------ driver API

    @property
    def now(self) -> float:
        return self.clock.now()

    def submit(self, req: Request, prompt_ids: list[int] | None = None) -> None:
        """Queue `req` (FCFS). `prompt_ids`: its prompt's token ids (else `tokenize(req.call)`);
        they must number `req.call.input_length` and match `req.call.hash_ids`."""
        if req.finish_reason is not None:
            raise EngineError(f"call {req.call.workflow_id} step {req.call.step} already finished")
        if prompt_ids is not None:
            self._prompts[id(req)] = list(prompt_ids)
        super().submit(req)

    def generate(self, token_ids: list[int], max_new_tokens: int, workflow: int | None = None,
                 agent: str = DEFAULT_AGENT, sampling: Sampling | None = None) -> Output:
        """Serve one prompt given as token ids to completion (no driver needed)."""
        if not token_ids:
            raise ValueError("empty prompt")
        n = self._events.scheduled
        call = Call(f"generate-{n}", 0, agent, len(token_ids), max_new_tokens,
                    block_hashes(list(token_ids), self.tree.block_size))
        own = workflow is None
        workflow = -1 - n if own else workflow
        if own:
            self.start_workflow(workflow, call.workflow_id)
        req = Request(call=call, workflow=workflow, on_done=lambda r: None, sampling=sampling)
        self.submit(req, token_ids)
        self.run()
        if own:
            self.end_workflow(workflow)
        return req.result

    def export_prefix(self, keys: list[int], first: int = 0) -> tuple[int, object]:
        """(blocks, CPU KV) of the longest prefix of `keys` cached here, from block `first` on, for
        another replica (`peer.py`); changes nothing in this engine's cache."""
        blocks, kv = export_prefix(self.tree, self.store, keys, first)
        self.peer.counters.blocks_sent += blocks
        return blocks, kv

    def run(self) -> None:
        """Serve until no request, event or transfer is left."""
        while self.step():
            pass

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ step-wise API

    def step(self) -> bool:
        """One scheduling iteration (see the module docstring). False: nothing was left to do."""
        self._fire_events()
        self._poll_transfers()
        if self._waiting and self._prefill_next():
            return True
        if self._running:
            self._prefetch()
            self._decode_step()
        elif self._transfers:
            self._poll_transfers(block=True)
        elif self._blocked and self._unpin_waiting():
            pass   # nothing runs or loads, so no event can free memory: do not wait for one
        elif self._events:
            self.clock.skip_to(self._events.next_time())
        elif self._waiting:
            if not self._unpin_waiting():
                raise Stuck(self._stuck_message(self._waiting[0]), self._waiting[0])
        else:
            return False
        return True

    def cancel(self, req: Request, reason: str = CANCELLED) -> bool:
        """End `req` now with `reason`, wherever it is: waiting, loading its prefix (the load is
        aborted: its reservation and pins are released, data still being read is discarded) or
        running (its working KV is dropped). Its reservation and pin are released, the policy
        hears `on_call_end` and `on_done` runs, as for any end. Returns False (changing nothing)
        when the engine does not hold `req`: finished, or not submitted yet."""
        if req.finish_reason is not None:
            return False
        if any(r is req for r in self._waiting):
            self._waiting.remove(req)
            if req.loading:
                self._abort_load(req)
        else:
            seq = next((s for s in self._running if s.req is req), None)
            if seq is None:
                return False
            self._running.remove(seq)
        self._finish(req, reason)
        return True

    @property
    def busy(self) -> bool:
        """Whether `step()` has anything to do: a request, a transfer or a scheduled event."""
        return bool(self._waiting or self._running or self._transfers or self._events)

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet prefilled (those loading their prefix included)."""
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        """Requests generating (prefilled, not finished)."""
        return len(self._running)

    @property
    def requests(self) -> tuple[Request, ...]:
        """Every request the engine holds: waiting (FCFS order), then running."""
        return tuple(self._waiting) + tuple(s.req for s in self._running)
