"""Two real engines in one process sharing a KV directory: B loads the prefix A computed,
counted on the "shared" tier, with outputs identical to a run without the directory."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import (LOGIT_ATOL, BS, assert_same_as_reference, check, lm, random_prompt,  # noqa: F401
                        serve_call)
from pbkv.cache import Capacities, RadixTree, TieredCache
from pbkv.engine.base import SHARED
from pbkv.engine.hf import EngineOptions, HFEngine, ManualClock, Worker, block_hashes, load_model
from pbkv.engine.hf.shared import identity
from pbkv.policy import PolicyContext, make_policy

P = random_prompt(11, 24)                     # the workflow's shared prefix: 6 blocks of 4
X, Y = random_prompt(12, 6), random_prompt(13, 9)


def engine_for(lm, shared_dir=None, rule="load", device=200, **kw):  # noqa: F811
    pol = make_policy("lru", PolicyContext(block_size=BS))
    cache = TieredCache(RadixTree(BS), Capacities(device, 0, 0), pol)
    return HFEngine(lm, cache, pol, clock=ManualClock(), worker=Worker(inline=True),
                    options=EngineOptions(load_rule=rule, record_logits=True), shared_dir=shared_dir, **kw)


serve = serve_call


def test_replica_b_loads_a_prefix_from_the_shared_tier(lm, tmp_path):
    a, b, alone = engine_for(lm, tmp_path), engine_for(lm, tmp_path), engine_for(lm)
    first = serve(a, P + X, 3)
    assert first.hits() == {"device": 0, "host": 0, "disk": 0, "shared": 0}
    assert a.shared.counters.blocks_written == (len(P) + len(X)) // BS   # every full block, once
    got, want = serve(b, P + Y, 3), serve(alone, P + Y, 3)
    assert got.hits() == {"device": 0, "host": 0, "disk": 0, "shared": len(P)}
    assert got.recomputed == len(Y) and want.recomputed == len(P + Y)
    assert b.stats.computed_tokens == len(Y) and b.stats.loaded_tokens[SHARED] == len(P)
    assert got.result.tokens == want.result.tokens
    for g, w in zip(got.result.logits, want.result.logits):
        torch.testing.assert_close(g, w, atol=LOGIT_ATOL, rtol=1e-4)
    assert_same_as_reference(lm, P + Y, got.result, 3)
    again = serve(b, P + Y, 2)           # now local: the device tier serves it, not the directory
    assert again.hits()["device"] == len(P + Y) - 1 and again.hits()["shared"] == 0
    check(b)
    for e in (a, b, alone):
        e.close()


def test_the_whole_prompt_from_the_directory_still_computes_its_last_token(lm, tmp_path):
    a, b = engine_for(lm, tmp_path), engine_for(lm, tmp_path)
    serve(a, P, 2)
    got = serve(b, P, 2)
    assert got.hits()["shared"] == len(P) - 1 and b.stats.computed_tokens == 1
    assert_same_as_reference(lm, P, got.result, 2)


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-shape"])
def test_a_corrupt_shared_file_is_detected_and_recomputed(lm, tmp_path, damage):
    a, b = engine_for(lm, tmp_path), engine_for(lm, tmp_path)
    serve(a, P + X, 2)
    bad = a.shared.dir.path(block_hashes(P, BS)[2])   # the third block of the prefix
    raw = bad.read_bytes()
    if damage == "flip":
        bad.write_bytes(raw[:-8] + bytes(x ^ 0xFF for x in raw[-8:]))
    elif damage == "truncate":
        bad.write_bytes(raw[:len(raw) // 2])
    else:   # a valid file of another geometry, stored under this key by the directory's own writer
        a.shared.dir.path(block_hashes(P, BS)[2]).unlink()
        a.shared.dir.put(block_hashes(P, BS)[2], torch.zeros(lm.layers, 2, lm.kv_heads, BS + 1, lm.head_dim))
    got = serve(b, P + Y, 3)
    assert got.hits()["shared"] == 2 * BS                  # the run stops before the bad block
    assert b.shared.dir.stats.corrupt == 1
    assert_same_as_reference(lm, P + Y, got.result, 3)
    assert b.shared.dir.get(block_hashes(P, BS)[2]) is not None   # B rewrote the block it recomputed
    c = engine_for(lm, tmp_path)   # so the next replica gets every full block of A's prompt
    assert serve(c, P + X, 2).hits()["shared"] == len(P + X) // BS * BS


def test_load_rules_decide_whether_the_directory_is_read(lm, tmp_path):
    serve(engine_for(lm, tmp_path), P + X, 2)
    assert serve(engine_for(lm, tmp_path, rule="recompute"), P + Y, 2).hits()["shared"] == 0
    # that engine still wrote what it computed: now all of P + Y's full blocks are there
    for prefill_tps, shared in ((1e12, 0), (1.0, len(P + Y) // BS * BS)):
        e = engine_for(lm, tmp_path, rule="auto")
        e.rates.prefill_tps = prefill_tps
        e.rates.saw_prefill = lambda *args: None   # keep the forced estimate
        assert serve(e, P + Y, 2).hits()["shared"] == shared


def test_another_model_never_reads_the_directory(lm, tmp_path):
    other = load_model("tiny", device="cpu", seed=1)   # same name and geometry, other weights
    assert identity(other) != identity(lm)
    serve(engine_for(lm, tmp_path), P + X, 2)
    got = serve(engine_for(other, tmp_path), P + Y, 2)
    assert got.hits()["shared"] == 0


def test_one_edited_weight_or_another_rope_base_is_another_model():
    """Before: the identity hashed ~1,024 strided values per tensor and no config, so a
    checkpoint with one embedding row edited, or the same weights under another RoPE base, read
    the other's KV (and changed its greedy output)."""
    base = identity(load_model("tiny", device="cpu"))
    edited = load_model("tiny", device="cpu")
    with torch.no_grad():
        edited.model.model.embed_tokens.weight[7, 3] += 1e-3   # a value no strided sample reads
    rope = load_model("tiny", device="cpu")
    rope.model.config.rope_parameters = {**rope.model.config.rope_parameters, "rope_theta": 5000.0}
    moved = load_model("tiny", device="cpu")
    moved.model.config._name_or_path = "/elsewhere/tiny"        # where it was loaded from: the same KV
    assert identity(load_model("tiny", device="cpu")) == base == identity(moved)
    assert identity(edited) != base and identity(rope) != base


def test_the_directory_stays_within_its_bound(lm, tmp_path):
    per_block = lm.kv_bytes_per_token * BS
    e = engine_for(lm, tmp_path, shared_bytes=10 * per_block)
    for i in range(6):
        serve(e, random_prompt(100 + i, 24), 1, name=f"wf{i}")
    e.shared.dir.evict()
    assert 0 < e.shared.dir.total_bytes() <= 10 * per_block


def test_a_folder_that_cannot_be_written_is_logged_once_not_per_write(lm, tmp_path, monkeypatch, caplog):
    import errno
    import logging
    from pbkv.engine.hf.shared import SharedTier
    from pbkv.engine.shared_kv import SharedKVDir
    tier = SharedTier(tmp_path, lm, BS, 1 << 20)

    def read_only(self, *a):
        raise OSError(errno.EROFS, "Read-only file system", str(self.directory / "ab"))
    monkeypatch.setattr(SharedKVDir, "put", read_only)
    with caplog.at_level(logging.WARNING, logger="pbkv.engine"):
        assert tier.write(list(range(2500)), torch.zeros(1, 1, 1, 2500 * BS, 1)) == 0
    assert tier.counters.write_errors == 2500
    lines = [r.getMessage() for r in caplog.records if "shared KV folder" in r.getMessage()]
    assert len(lines) == 3                                   # the 1st, 1,000th and 2,000th
    assert f"cannot write to the shared KV folder {tmp_path} (1 failed writes so far" in lines[0]
    assert "Read-only file system" in lines[0] and "(2000 failed writes so far" in lines[2]
