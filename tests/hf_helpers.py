"""Builders for the real-engine tests: the tiny model, engines over it, reference generations."""

from __future__ import annotations

import pytest
import torch

from pbkv.cache import Capacities, RadixTree, TieredCache
from pbkv.engine.hf import EngineOptions, HFEngine, ManualClock, Worker, load_model
from pbkv.engine.hf.model import reference_logits
from pbkv.policy import PolicyContext, make_policy

BS = 4  # tokens per block: small, so that short prompts span many nodes


@pytest.fixture(scope="module")
def lm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared 2-core machine: one thread is far faster
    yield load_model("tiny", device="cpu")
    torch.set_num_threads(threads)


def make_engine(lm, device=64, host=0, disk=0, policy="lru", ctx=None, rule="load", inline=True, **opts):
    pol = make_policy(policy, ctx or PolicyContext(block_size=BS))
    cache = TieredCache(RadixTree(BS), Capacities(device, host, disk), pol)
    engine = HFEngine(lm, cache, pol, clock=ManualClock(), worker=Worker(inline=inline),
                      options=EngineOptions(load_rule=rule, record_logits=True, **opts))
    return engine


_refs: dict = {}


def reference(lm, prompt: list[int], n: int):
    """Greedy tokens and per-token logits with a full forward pass for every token (no cache)."""
    key = (tuple(prompt), n)
    if key not in _refs:
        ids, toks, logits = list(prompt), [], []
        for _ in range(n):
            lg = reference_logits(lm, ids)
            logits.append(lg)
            toks.append(int(lg.argmax()))
            ids.append(toks[-1])
        _refs[key] = (toks, logits)
    return _refs[key]


LOGIT_ATOL = 1e-3   # cached vs full forward: float32 sums in another order; logits of the tiny model reach ~10,
# and a CPU's kernels move the last digits (1.3e-4 seen on one Xeon); a wrong KV block moves them by ~1


def assert_same_as_reference(lm, prompt, out, n):
    toks, logits = reference(lm, prompt, n)
    assert out.tokens == toks
    assert len(out.logits) == len(logits)
    for got, want in zip(out.logits, logits):
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=1e-4)


def serve_call(engine, prompt: list[int], n: int, name: str = "wf"):
    """One workflow call of `prompt` to completion, `n` tokens; the engine's request (hits per tier)."""
    from pbkv.engine.hf import block_hashes
    from pbkv.engine.request import Request
    from pbkv.trace import Call
    call = Call(name, 0, "agent", len(prompt), n, block_hashes(prompt, BS))
    engine.start_workflow(1, name)
    req = Request(call=call, workflow=1, on_done=lambda r: None)
    engine.submit(req, prompt)
    engine.run()
    engine.end_workflow(1)
    return req


def check(engine) -> None:
    """Every cache and storage invariant: accounting, tree, tensors in their tiers, no orphan files."""
    engine.store.worker.drain()
    engine.cache.check()
    engine.store.check(engine.tree)


def random_prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(64, 512, (length,), generator=g).tolist()
