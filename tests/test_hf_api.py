"""The real engine's public step-wise API: step, cancel (waiting, loading, running), per-request
sampling and stop conditions, the read-only views. After every cancel nothing stays reserved
or pinned and the cache invariants hold."""

from concurrent.futures import Future

import pytest

from hf_helpers import BS, assert_same_as_reference, check, lm, make_engine, random_prompt, reference  # noqa: F401
from pbkv.cache import Tier
from pbkv.engine.hf import Stuck, Worker, block_hashes
from pbkv.engine.sampling import CANCELLED, LENGTH, STOP, Sampling
from pbkv.engine.request import Request
from pbkv.trace import Call

A, B, C, D = (random_prompt(s, 24) for s in (21, 22, 23, 24))


class Gate(Worker):
    """An inline worker that holds every task while closed: a load stays in flight until `open`."""

    def __init__(self):
        super().__init__(inline=True)
        self.closed, self.held = True, []

    def submit(self, fn, *args, **kwargs) -> Future:
        if not self.closed:
            return super().submit(fn, *args, **kwargs)
        fut: Future = Future()
        self.held.append((fut, fn, args, kwargs))
        return fut

    def open(self) -> None:
        self.closed = False
        held, self.held = self.held, []
        for fut, fn, args, kwargs in held:
            fut.set_result(fn(*args, **kwargs))

    drain = open


def request(engine, prompt, n, done=None, step=0, **kw):
    """Submit `prompt` for `n` new tokens as its own workflow; `done` collects finished requests."""
    call = Call(f"t{id(prompt)}-{step}", step, "a", len(prompt), n, block_hashes(prompt, BS))
    engine.start_workflow(step, call.workflow_id)
    req = Request(call=call, workflow=step, on_done=(done.append if done is not None else lambda r: None), **kw)
    engine.submit(req, prompt)
    return req


def assert_free(engine):
    """Nothing reserved, nothing pinned, nothing left to do; every invariant holds."""
    assert engine.cache.reserved == 0 and engine.cache.locked == [0, 0, 0]
    assert not engine.busy and engine.step() is False
    check(engine)


def test_step_is_one_iteration_and_reports_when_nothing_is_left(lm):
    engine = make_engine(lm, device=400)
    assert engine.step() is False and not engine.busy
    done = []
    r1, r2 = request(engine, A, 3, done), request(engine, B, 2, done, step=1)
    assert (engine.queue_depth, engine.running_count, engine.requests) == (2, 0, (r1, r2))
    assert engine.step() and (engine.queue_depth, engine.running_count) == (1, 1)     # prefill r1
    assert engine.step() and (engine.queue_depth, engine.running_count) == (0, 2)     # prefill has priority
    assert engine.requests == (r1, r2) and len(r1.result.tokens) == 1
    assert engine.step() and len(r1.result.tokens) == 2 and len(r2.result.tokens) == 2  # one decode step
    assert done == [r2] and r2.finish_reason == LENGTH and engine.requests == (r1,)
    steps = 0
    while engine.step():
        steps += 1
    assert steps == 1 and done == [r2, r1] and engine.stats.prefills == 2
    assert_same_as_reference(lm, A, r1.result, 3)
    assert_same_as_reference(lm, B, r2.result, 2)
    assert_free(engine)


def test_cancel_while_waiting(lm):
    engine = make_engine(lm, device=400)
    engine.generate(A, 1)                       # A cached: the waiting request's prefix
    done = []
    req = request(engine, A + [5, 6], 4, done)
    assert engine.cancel(req) and done == [req] and req.finish_reason == CANCELLED
    assert req.result is None and engine.queue_depth == 0
    assert not engine.cancel(req) and done == [req]   # a second cancel changes nothing
    assert_free(engine)
    never = Request(call=req.call, workflow=0, on_done=done.append)
    assert not engine.cancel(never)                   # not submitted: not the engine's


def test_cancel_while_decoding_frees_the_reservation_and_the_pin(lm):
    engine = make_engine(lm, device=400)
    done = []
    req = request(engine, A, 10, done, sampling=Sampling(max_new_tokens=7))
    engine.step()
    assert engine.running_count == 1 and engine.cache.reserved == 7    # the prompt went into the tree
    assert engine.cache.locked[Tier.DEVICE] == len(A)
    engine.step()
    assert engine.cancel(req) and req.finish_reason == CANCELLED and done == [req]
    assert_same_as_reference(lm, A, req.result, 2)   # what it produced before the cancel is kept
    assert_free(engine)


def test_a_callback_may_cancel_itself_or_another_request(lm):
    engine = make_engine(lm, device=400)
    done = []
    other = []

    def first(req, token):
        if len(req.result.tokens) == 2:
            engine.cancel(other[0])
        if len(req.result.tokens) == 4:
            engine.cancel(req)
        return False
    r1 = request(engine, A, 8, done, on_token=first)
    other.append(request(engine, B, 8, done, step=1))
    engine.run()
    assert [r.finish_reason for r in done] == [CANCELLED, CANCELLED] and done == [other[0], r1]
    assert r1.result.tokens == reference(lm, A, 4)[0]
    assert other[0].result.tokens == reference(lm, B, 8)[0][:len(other[0].result.tokens)]
    assert_free(engine)


def loaded_setup(lm, tier):
    """Device C, D; B on host; A on host (tier HOST) or on disk (tier DISK). Worker gated."""
    engine = make_engine(lm, device=64, host=48 if tier == Tier.HOST else 24, disk=400, max_running=1)
    for p in (A, B, C, D):
        engine.generate(p, 2)
    engine.store.worker.drain()
    node, _ = engine.tree.match(block_hashes(A, BS))
    assert node.tier == tier and engine.tree.match(block_hashes(D, BS))[0].tier == Tier.DEVICE
    engine.store.worker = Gate()
    return engine


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
@pytest.mark.parametrize("when", ["loading", "loaded"])
def test_cancel_while_loading_a_prefix(lm, tier, when):
    engine = loaded_setup(lm, tier)
    done = []
    loader = request(engine, A + [3], 2, done)           # its prefix has to come up from `tier`
    waiter = request(engine, A + [4], 2, done, step=1)   # waits for that same load
    runner = request(engine, D + [1, 2], 6, done, step=2)
    engine.step()  # loader starts its load; waiter waits for it; runner is prefilled
    assert loader.loading and not waiter.loading and engine.running_count == 1
    assert engine.cache.reserved > 6 and engine.cache.locked[tier] == len(A)
    if when == "loaded":
        engine.store.worker.open()
        engine.step()  # the load is installed; max_running=1 keeps both waiting, loader pinning A
        assert not loader.loading and loader.node is not None and engine.cache.locked[Tier.DEVICE] > len(D) + 2
    assert engine.cancel(loader) and loader.finish_reason == CANCELLED and done == [loader]
    runner_pin = sum(n.tokens for n in runner.node.path())
    assert engine.cache.reserved == 6 and engine.cache.locked == [runner_pin, 0, 0]
    assert engine.queue_depth == 1 and engine.requests == (waiter, runner)
    if when == "loading":  # the aborted load left A where it was
        assert engine.tree.match(block_hashes(A, BS))[0].tier == tier and loader.disk_hit + loader.host_hit == 0
    assert engine.cancel(runner) and engine.cache.reserved == 0 and engine.cache.locked == [0, 0, 0]
    engine.store.worker.open()   # a discarded read of the aborted load may run now
    engine.run()                 # the waiter is served after all: loaded anew, or found on the device
    assert done == [loader, runner, waiter] and waiter.finish_reason == LENGTH
    assert engine.stats.loaded_tokens[tier] == len(A) and engine.stats.load_waits == 1   # loaded once
    assert_same_as_reference(lm, A + [4], waiter.result, 2)
    assert_same_as_reference(lm, D + [1, 2], runner.result, len(runner.result.tokens))
    assert_free(engine)


def test_stop_tokens_eos_and_on_token_end_a_request_with_stop(lm):
    toks = reference(lm, A, 8)[0]
    k = next(i for i in range(2, 8) if toks[i] not in toks[:i])   # a token first produced at position k
    engine = make_engine(lm, device=400, eos_token_ids=frozenset({toks[k]}))
    out = engine.generate(A, 8)
    assert out.tokens == toks[:k]                                 # EOS ends it and is not output
    assert engine.generate(A, 8, sampling=Sampling(ignore_eos=True)).tokens == toks
    out = engine.generate(A, 8, sampling=Sampling(ignore_eos=True, stop_token_ids=frozenset({toks[1]})))
    assert out.tokens == toks[:1]
    seen, done = [], []
    req = request(engine, A, 8, done, sampling=Sampling(ignore_eos=True),
                  on_token=lambda r, t: seen.append(t) or len(seen) == 3)
    engine.run()
    assert seen == toks[:3] == req.result.tokens and req.finish_reason == STOP
    req = request(engine, A, 8, done, step=1, sampling=Sampling(max_new_tokens=2, ignore_eos=True))
    engine.run()
    assert req.result.tokens == toks[:2] and req.finish_reason == LENGTH
    assert_free(engine)


def test_per_request_sampling(lm):
    engine = make_engine(lm, device=400)

    def draw(**kw):
        return engine.generate(A, 8, sampling=Sampling(**kw)).tokens
    assert draw(temperature=1.0, seed=5) == draw(temperature=1.0, seed=5)   # seeded: repeatable
    assert draw(temperature=1.0, seed=5) != draw(temperature=1.0, seed=6)
    assert draw(temperature=1.0, top_p=1e-6, seed=5) == reference(lm, A, 8)[0]  # the nucleus of one: greedy
    assert draw(temperature=0.0) == reference(lm, A, 8)[0]
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def test_a_request_that_can_never_fit_raises_stuck_and_can_be_cancelled(lm):
    engine = make_engine(lm, device=16)
    done = []
    req = request(engine, A, 4, done)
    with pytest.raises(Stuck, match="needs 28 device tokens") as e:
        engine.step()
    assert e.value.request is req and engine.queue_depth == 1   # nothing changed
    assert engine.cancel(req, "error") and req.finish_reason == "error" and done == [req]
    assert_free(engine)
