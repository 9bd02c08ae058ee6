"""Trace block ids -> token ids, real tokens -> chained ids, and trace scaling for the real engine."""

import pytest

from pbkv.engine.hf.tokens import TokenMapper, block_hashes, scale_geometry, scale_trace
from pbkv.trace import Call, Trace, TraceMeta, validate
from pbkv.workloads import generate, load_spec


def test_equal_ids_give_equal_tokens_and_cut_blocks_are_prefixes():
    m = TokenMapper(512, 16, seed=0)
    a = m.tokens(Call("w", 0, "x", 40, 1, [7, 8, 9]))
    b = m.tokens(Call("w", 1, "x", 48, 1, [7, 8, 10]))
    c = m.tokens(Call("w", 2, "x", 48, 1, [7, 8, 9]))
    assert len(a) == 40 and a[:32] == b[:32] and a[32:] != b[32:40] and c[:40] == a
    assert all(m.low <= t < 512 for t in a)
    assert TokenMapper(512, 16, seed=0).tokens(Call("w", 0, "x", 40, 1, [7, 8, 9])) == a
    with pytest.raises(ValueError, match="cannot hold"):
        m.tokens(Call("w", 0, "x", 40, 1, [7, 8]))


def test_block_hashes_are_chained():
    x = list(range(40))
    h1, h2 = block_hashes(x, 16), block_hashes(x[:32] + [99] * 8, 16)
    assert len(h1) == 3 and h1[:2] == h2[:2] and h1[2] != h2[2]
    assert block_hashes([5] + x[1:], 16)[1] != h1[1]  # a change in block 0 changes every later id
    assert block_hashes(x[:20], 16)[1] != h1[1]       # a partial block differs from the full one


def shared_blocks(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("factor", [1, 2, 4, 16, 64])
def test_scaling_keeps_structure_and_divides_lengths(factor):
    trace = generate(load_spec("hover"), 6, 0)
    scaled = scale_trace(trace, factor)
    validate(scaled)
    bs, stride = scale_geometry(16, factor)
    assert scaled.block_size == bs
    ratio = sum(c.input_length for c in trace.calls) / sum(c.input_length for c in scaled.calls)
    assert ratio == pytest.approx(factor, rel=0.2)
    for a, sa in zip(trace.calls, scaled.calls):
        assert (sa.workflow_id, sa.step, sa.agent) == (a.workflow_id, a.step, a.agent)
        assert (sa.output_length > 0) == (a.output_length > 0)
    calls = list(zip(trace.calls, scaled.calls))
    for (a, sa), (b, sb) in zip(calls, calls[1:]):  # sharing kept: kept blocks of a shared prefix
        n = shared_blocks(a.hash_ids, b.hash_ids)
        assert shared_blocks(sa.hash_ids, sb.hash_ids) >= (n + 1) // stride - 1
        assert set(sa.hash_ids) <= set(a.hash_ids)


def test_scale_must_be_at_least_one():
    trace = Trace(TraceMeta(block_size=16), [Call("w", 0, "a", 20, 1, [1, 2])])
    with pytest.raises(ValueError, match="--scale"):
        scale_trace(trace, 0.5)
    assert scale_trace(trace, 1) is trace


def test_output_scale_divides_outputs_only():
    trace = generate(load_spec("hover"), 4, 0)
    both, outs = scale_trace(trace, 4), scale_trace(trace, 4, output_factor=40)
    assert [c.input_length for c in both.calls] == [c.input_length for c in outs.calls]
    assert all(o.output_length == max(1, round(c.output_length / 40)) for c, o in zip(trace.calls, outs.calls))
    with pytest.raises(ValueError, match="--output-scale"):
        scale_trace(trace, 4, output_factor=0.5)
