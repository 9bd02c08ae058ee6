"""KV moved between two live engines (`pbkv.engine.hf.peer`): A exports the prefix it caches, in
any tier, B reads it for the call routed there, counted on the "shared" tier, outputs identical
to an engine that computed everything."""

from __future__ import annotations

import torch

from hf_helpers import (LOGIT_ATOL, BS, assert_same_as_reference, check, lm, make_engine, random_prompt,  # noqa: F401
                        serve_call)
from pbkv.engine.base import SHARED
from pbkv.engine.hf import block_hashes
from pbkv.engine.hf.peer import PeerInbox, fetch_start, held_blocks

P = random_prompt(21, 24)                     # the workflow's prefix on A: 6 blocks of 4
X, Y = random_prompt(22, 6), random_prompt(23, 9)


def engine_for(lm, device=200, host=0, disk=0, rule="load"):  # noqa: F811
    return make_engine(lm, device, host, disk, rule=rule)


serve = serve_call


def test_b_reads_the_prefix_a_exported_and_answers_as_if_it_computed_it(lm):
    a, b, alone = engine_for(lm), engine_for(lm), engine_for(lm)
    serve(a, P + X, 3)
    keys = block_hashes(P + Y, BS)
    blocks, kv = a.export_prefix(keys)
    assert blocks == len(P) // BS and kv.device.type == "cpu" and kv.shape[3] == len(P)
    assert b.peer.put(keys[:blocks], kv) == blocks
    got, want = serve(b, P + Y, 3), serve(alone, P + Y, 3)
    assert got.hits() == {"device": 0, "host": 0, "disk": 0, "shared": len(P)}
    assert b.stats.loaded_tokens[SHARED] == len(P) and b.stats.computed_tokens == len(Y)
    assert got.result.tokens == want.result.tokens
    for g, w in zip(got.result.logits, want.result.logits):
        torch.testing.assert_close(g, w, atol=LOGIT_ATOL, rtol=1e-4)
    assert_same_as_reference(lm, P + Y, got.result, 3)
    assert not b.peer.blocks and b.peer.bytes == 0            # read once, then the tree holds it
    assert a.peer.counters.blocks_sent == blocks and b.peer.counters.blocks_received == blocks == b.peer.counters.blocks_read
    check(a)
    check(b)
    for e in (a, b, alone):
        e.close()


def test_an_export_reads_host_and_disk_nodes_and_moves_nothing(lm):
    a = engine_for(lm, device=40, host=36, disk=200)
    serve(a, P + X, 2, "first")
    serve(a, random_prompt(24, 36), 2, "second")            # the first prompt to host,
    serve(a, random_prompt(27, 36), 2, "third")             # then to disk
    first = [n for n in a.tree.iter_nodes() if n.blocks[0] == block_hashes(P, BS)[0]]
    assert [n.tier.name for n in first] == ["DISK"]
    assert held_blocks(a.tree, block_hashes(P, BS))[0] == len(P) // BS   # on disk: held all the same
    before = [(n.id, n.tier, n.last_access) for n in a.tree.iter_nodes()]
    blocks, kv = a.export_prefix(block_hashes(P, BS))
    assert blocks == len(P) // BS
    assert [(n.id, n.tier, n.last_access) for n in a.tree.iter_nodes()] == before
    b = engine_for(lm)
    b.peer.put(block_hashes(P, BS), kv)
    got = serve(b, P + Y, 2)
    assert got.hits()["shared"] == len(P)
    assert_same_as_reference(lm, P + Y, got.result, 2)
    a.close()
    b.close()


def test_a_partial_last_block_is_not_exported(lm):
    a = engine_for(lm)
    prompt = P + random_prompt(25, BS - 1)                   # 6 whole blocks and a partial one
    serve(a, prompt, 2)
    blocks, kv = a.export_prefix(block_hashes(prompt, BS))
    assert blocks == len(P) // BS and kv.shape[3] == len(P)
    assert a.export_prefix(block_hashes(random_prompt(26, 8), BS)) == (0, None)
    assert held_blocks(a.tree, block_hashes(prompt, BS))[0] == len(P) // BS
    assert held_blocks(a.tree, block_hashes(P[:10], BS))[0] == 2         # whole blocks of a shorter prompt
    n, tail = a.export_prefix(block_hashes(prompt, BS), first=2)   # B holds the first two blocks
    assert n == len(P) // BS - 2 and torch.equal(tail, kv[:, :, :, 2 * BS:])
    a.close()


def test_a_fetch_starts_where_the_held_prefix_ends_and_only_if_the_load_rule_would_read_it(lm):
    b = engine_for(lm, rule="auto")
    serve(b, P[:8] + X, 2)                                    # b holds P's first two blocks
    keys = block_hashes(P + Y, BS)[:6]                        # the router: fetch up to block 6
    assert fetch_start(b, keys, first=4) == 2                 # the router's view said 4: b holds 2
    assert fetch_start(b, keys, first=1) == 1
    assert fetch_start(b, keys[:2], first=2) is None          # nothing left to fetch
    b.rates.prefill_tps = 1e9                                 # recomputing 4 blocks beats one load
    assert fetch_start(b, keys, first=4) is None
    b.opts.load_rule = "load"
    assert fetch_start(b, keys, first=4) == 2
    b.opts.load_rule = "recompute"
    assert fetch_start(b, keys, first=4) is None
    b.close()


def test_no_fetch_when_the_prefix_held_below_the_device_would_be_recomputed(lm):
    b = engine_for(lm, device=40, host=200, rule="auto")
    serve(b, P[:8] + X, 2, "first")
    serve(b, random_prompt(24, 36), 2, "second")              # P's first two blocks go to host
    keys = block_hashes(P + Y, BS)[:6]
    assert {n.tier.name for n in b.tree.iter_nodes() if n.blocks[0] == keys[0]} == {"HOST"}
    b.rates.prefill_tps = 1000.0                              # reading 4 blocks from a peer pays,
    b.rates.load_bps[1] = 1.0                                 # loading 2 from host does not
    assert fetch_start(b, keys, first=4) is None
    b.rates.load_bps[1] = 1e15                                # host loads pay: admission loads
    assert fetch_start(b, keys, first=4) == 2                 # them, then reads the inbox
    b.rates.load_bps[1] = 1.0
    b.opts.load_rule = "load"
    assert fetch_start(b, keys, first=4) == 2
    # why: a call that recomputes the host part computes the rest too, inbox or not
    b.opts.load_rule = "auto"
    a = engine_for(lm)
    serve(a, P + X, 2)
    n, kv = a.export_prefix(keys, first=2)
    assert b.peer.put(keys[2:2 + n], kv) == n == 4
    got = serve(b, P + Y, 2)
    assert got.hits()["shared"] == 0 and b.peer.counters.blocks_read == 0
    assert_same_as_reference(lm, P + Y, got.result, 2)
    a.close()
    b.close()


def test_the_inbox_is_bounded_oldest_blocks_dropped_first():
    box = PeerInbox(block_size=4, device=torch.device("cpu"), max_bytes=3 * 4 * 4)   # 3 blocks of 4 floats
    kv = torch.arange(20, dtype=torch.float32).reshape(1, 1, 1, 20, 1)
    assert box.put([1, 2, 3, 4, 5], kv) == 5
    assert list(box.blocks) == [3, 4, 5] and box.counters.blocks_unused == 2
    assert box.read([1, 2]) is None
    out = box.read([3, 4, 9])
    assert out[0, 0, 0, :, 0].tolist() == list(range(8, 16)) and list(box.blocks) == [5]
