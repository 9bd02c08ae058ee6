"""Failure isolation in the real engine's step (issue 14, defect 1): an exception raised by one
request's own work (its on_token callback, its sampling, its prefill or decode forward pass) ends
that request alone with "error" and frees what it holds; the others complete with exactly the
outputs they have when served alone."""

import pytest

import pbkv.engine.hf.execute as execute
from hf_helpers import BS, check, lm, make_engine, random_prompt  # noqa: F401
from pbkv.engine.hf import block_hashes
from pbkv.engine.request import Request
from pbkv.engine.sampling import ERROR, LENGTH, Sampling
from pbkv.trace import Call

PROMPTS = [random_prompt(s, 20 + s) for s in range(4)]
SAMPLING = [Sampling(temperature=0.0), Sampling(temperature=0.8, seed=11), Sampling(temperature=0.0),
            Sampling(temperature=1.2, top_p=0.9, seed=2**64 + 7)]   # a seed beyond 64 bits is mapped, not fatal
N = 10


def submit(engine, i, done, on_token=None, sampling=None):
    prompt = PROMPTS[i]
    call = Call(f"w{i}", 0, "a", len(prompt), N, block_hashes(prompt, BS))
    engine.start_workflow(i, call.workflow_id)
    req = Request(call=call, workflow=i, on_done=done.append, sampling=sampling or SAMPLING[i], on_token=on_token)
    engine.submit(req, prompt)
    return req


def alone(lm, i) -> list[int]:
    engine = make_engine(lm, device=400)
    done: list = []
    req = submit(engine, i, done)
    engine.run()
    return req.result.tokens


@pytest.fixture(scope="module")
def solo(lm):
    return [alone(lm, i) for i in range(len(PROMPTS))]


def run_all(lm, bad: int, **kw):
    engine = make_engine(lm, device=400)
    done: list = []
    reqs = [submit(engine, i, done, **(kw if i == bad else {})) for i in range(len(PROMPTS))]
    engine.run()
    assert sorted(map(id, done)) == sorted(map(id, reqs))          # every request ended, once
    assert engine.cache.reserved == 0 and engine.cache.locked == [0, 0, 0]   # nothing held
    check(engine)
    return reqs


def assert_others_unchanged(reqs, bad, solo):
    for i, req in enumerate(reqs):
        if i != bad:
            assert req.finish_reason == LENGTH and req.error is None
            assert req.result.tokens == solo[i], f"request {i} changed"


def test_an_on_token_callback_that_raises_ends_only_its_request(lm, solo):
    def on_token(req, token):
        if len(req.result.tokens) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return False
    reqs = run_all(lm, 1, on_token=on_token)
    assert reqs[1].finish_reason == ERROR and reqs[1].error.startswith("UnicodeDecodeError")
    assert reqs[1].result.tokens == solo[1][:3]
    assert_others_unchanged(reqs, 1, solo)


@pytest.mark.parametrize("at", [1, 4])   # its first token (in prefill) or a later one (in decode)
def test_a_sampler_that_raises_for_one_request_ends_only_it(lm, solo, monkeypatch, at):
    real, marker = execute.sample, 0.123   # the bad request's top_p marks it

    def sample(logits, temperature, top_p, gen):
        if top_p == marker and sample.calls.setdefault("n", 0) + 1 >= at:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        if top_p == marker:
            sample.calls["n"] += 1
        return real(logits, temperature, top_p, gen)
    sample.calls = {}
    monkeypatch.setattr(execute, "sample", sample)
    reqs = run_all(lm, 2, sampling=Sampling(temperature=0.5, top_p=marker, seed=3))
    assert reqs[2].finish_reason == ERROR and "invalid multinomial" in reqs[2].error
    assert len(reqs[2].result.tokens) == at - 1
    assert_others_unchanged(reqs, 2, solo)


def test_a_prefill_forward_that_raises_for_one_request_ends_only_it(lm, solo, monkeypatch):
    real, bad_length = execute.forward, len(PROMPTS[0])

    def forward(model, tokens, cache):
        if len(tokens) == bad_length:
            raise MemoryError("out of memory in this request's prefill")
        return real(model, tokens, cache)
    monkeypatch.setattr(execute, "forward", forward)
    reqs = run_all(lm, 0)
    assert reqs[0].finish_reason == ERROR and reqs[0].error.startswith("MemoryError")
    assert_others_unchanged(reqs, 0, solo)


def test_a_seed_beyond_64_bits_is_taken_modulo_2_63(lm):
    tokens = []
    for seed in (7, 2**64 + 7, 2**63 + 7):
        engine = make_engine(lm, device=400)
        req = submit(engine, 3, [], sampling=Sampling(temperature=1.2, top_p=0.9, seed=seed))
        engine.run()
        tokens.append(req.result.tokens)
    assert tokens[0] == tokens[1] == tokens[2]
