"""Failed loads and failed writes in the vLLM connector's spine and store, without vLLM.

vLLM runs a step as: the plan's moves and loads, the forward, the saves, then it reads the
failed loads (`get_block_ids_with_load_errors`) and, later, tells the scheduler's connector
(`update_connector_output` -> `Shadow.load_failed`). These tests play that order by hand."""

import shutil

import torch

from pbkv.cache import Capacities
from pbkv.integrations.vllm.hints import parse_hints
from pbkv.integrations.vllm.plan import tainted
from pbkv.integrations.vllm.shadow import Shadow
from pbkv.integrations.vllm.shared import SharedBlocks
from pbkv.integrations.vllm.store import BlockStore

BS = 4
BLOCKS = 16
IDENT = "vllm|test-model@-|float32|kv auto|bs 4|sha256|rank 0/1"


def pages(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BS, 8, generator=g) for i in range(2)}


def block(p, block_id):
    return torch.stack([t[block_id] for t in p.values()])


def schedule(sh, rid, keys, prompt, blocks, hashes=None):
    """The scheduler calls for a new request that runs its whole prompt in one step."""
    ext = sh.match(rid, keys, prompt, 0, parse_hints(None), hashes=hashes)
    sh.allocated(rid, 0, ext)
    return ext, sh.build([(rid, blocks, True, prompt)])


def step(store, plan):
    """The worker's step; returns the failed block ids vLLM would read."""
    store.before_forward(plan)
    store.after_forward(plan)
    failed, store.failed = store.failed, set()
    return failed


def test_tainted_is_every_block_from_the_first_failed_one_of_each_chain():
    chains = [[1, 2, 3, 4], [1, 2, 7], [9, 10]]
    assert tainted(chains, {2}) == {2, 3, 4, 7}
    assert tainted(chains, {4, 3}) == {3, 4}
    assert tainted(chains, set()) == set()


def first_request(tmp_path):
    """Request "a" computes keys 1-3 (blocks 0-2); the store holds them, key 2 on disk."""
    sh, store, p = Shadow(BS, Capacities(64, 64, 0)), BlockStore(tmp_path / "d"), pages(1)
    store.register(p, BLOCKS)
    _, plan = schedule(sh, "a", [1, 2, 3], 3 * BS + 1, [0, 1, 2, 3])
    step(store, plan)
    sh.finished("a")
    store.move("disk", 2)
    return sh, store, p


def test_a_failed_load_saves_nothing_computed_after_it(tmp_path):
    sh, store, p = first_request(tmp_path)
    next(iter(store.disk.values()))[0].write_bytes(b"garbage")   # key 2's file is damaged
    # "b" loads keys 1-3 into blocks 4-6 and computes keys 4-5 in blocks 7-8 in the same step
    ext, plan = schedule(sh, "b", [1, 2, 3, 4, 5], 5 * BS + 1, [4, 5, 6, 7, 8, 9])
    assert ext == 3 * BS and [k for k, _ in plan.saves] == [4, 5]
    assert plan.chains == [[4, 5, 6, 7, 8, 9]]
    assert step(store, plan) == {5}
    assert 4 not in store.ram and 5 not in store.ram     # blocks 7, 8 attended to garbage: not kept
    assert 2 not in store.disk and not list((tmp_path / "d").iterdir())   # the bad copy is forgotten


def test_a_step_without_loads_carries_no_chains(tmp_path):
    sh = Shadow(BS, Capacities(64, 64, 0))
    assert schedule(sh, "a", [1, 2, 3], 3 * BS + 1, [0, 1, 2, 3])[1].chains == []


def test_reported_keys_are_owed_unmatched_and_saved_again_by_whoever_computes_them(tmp_path):
    sh, store, p = first_request(tmp_path)
    next(iter(store.disk.values()))[0].write_bytes(b"garbage")
    _, plan = schedule(sh, "b", [1, 2, 3, 4, 5], 5 * BS + 1, [4, 5, 6, 7, 8, 9])
    failed = step(store, plan)
    sh.finished("b")               # kv_load_failure_policy "fail": the request is gone first
    assert sh.stats.host_hit_tokens == 3 * BS
    sh.load_failed(failed)
    assert sh.owed == {2, 3, 4, 5} and sh.stats.load_failed_blocks == 1
    # counted as hits when planned; vLLM recomputed the failed load and the one after it
    assert sh.stats.host_hit_tokens == BS and sh.stats.computed_tokens == (3 * BS + 1) + (5 * BS + 1) - BS
    # another request: offered key 1 only (nobody holds a valid 2 now), computes 2-5, saves them
    ext, plan = schedule(sh, "c", [1, 2, 3, 4, 5], 5 * BS + 1, [10, 11, 12, 13, 14, 15])
    assert ext == BS and plan.loads == [(1, 10)]
    assert sorted(plan.saves) == [(2, 11), (3, 12), (4, 13), (5, 14)] and not sh.owed
    assert step(store, plan) == set()
    for key, blk in plan.saves:
        assert torch.equal(store.ram[key], block(p, blk))
    sh.finished("c")
    sh.build([])
    sh.cache.check()


def test_the_recomputing_request_saves_its_owed_blocks_again(tmp_path):
    sh, store, p = first_request(tmp_path)
    next(iter(store.disk.values()))[0].write_bytes(b"garbage")
    _, plan = schedule(sh, "b", [1, 2, 3, 4, 5], 5 * BS + 1, [4, 5, 6, 7, 8, 9])
    sh.load_failed(step(store, plan))
    # kv_load_failure_policy "recompute": vLLM runs "b" again from block 5 on, in the same blocks
    plan = sh.build([("b", None, False, 5 * BS + 1)])
    assert sorted(plan.saves) == [(2, 5), (3, 6), (4, 7), (5, 8)] and not sh.owed
    step(store, plan)
    assert torch.equal(store.ram[4], block(p, 7))


def test_a_stale_copy_is_replaced_by_the_owed_save(tmp_path):
    store, p = BlockStore(tmp_path), pages(1)
    store.register(p, BLOCKS)
    store.save(7, 0)
    store.save(7, 1)
    assert torch.equal(store.ram[7], block(p, 1))


def test_an_owed_key_leaves_the_set_when_the_tree_drops_it(tmp_path):
    sh, store, _ = first_request(tmp_path)
    sh.owed.update({1, 2, 3})
    for rid, base in (("x", 10), ("y", 20), ("z", 30), ("w", 40)):   # fill device + host: 1-3 dropped
        keys = [base + i for i in range(8)]
        step(store, schedule(sh, rid, keys, 8 * BS + 1, list(range(9)))[1])
        sh.finished(rid)
    assert 1 not in sh.tree.index and not sh.owed


def test_a_failed_shared_load_poisons_neither_ram_nor_the_shared_dir(tmp_path):
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    keys = [int.from_bytes(h[:8], "little") >> 1 for h in hashes]
    a = Shadow(BS, Capacities(64, 64, 0), shared=SharedBlocks(tmp_path, [IDENT]))
    a_store, a_pages = BlockStore(None, shared=SharedBlocks(tmp_path, [IDENT])), pages(1)
    a_store.register(a_pages, BLOCKS)
    step(a_store, schedule(a, "a", keys[:2], 2 * BS + 1, [0, 1, 2], hashes=hashes[:2])[1])
    a_store._writer.submit(lambda: None).result()
    SharedBlocks(tmp_path, [IDENT]).dirs[0].path(int.from_bytes(hashes[0], "big")).write_bytes(b"bad")
    b = Shadow(BS, Capacities(64, 64, 0), shared=SharedBlocks(tmp_path, [IDENT]))
    b_store, b_pages = BlockStore(None, shared=SharedBlocks(tmp_path, [IDENT])), pages(2)
    b_store.register(b_pages, BLOCKS)
    ext, plan = schedule(b, "b", keys, 4 * BS + 1, [5, 6, 7, 8, 9], hashes=hashes)
    assert ext == 2 * BS and [blk for _, blk in plan.shared_saves] == [7, 8]
    failed = step(b_store, plan)
    b_store._writer.submit(lambda: None).result()
    assert failed == {5} and not b_store.ram and b_store.stats.shared_queued == 0
    assert SharedBlocks(tmp_path, [IDENT]).prefix(hashes[2:]) == 0   # nothing computed from garbage shared
    b.load_failed(failed)
    assert b.stats.shared_hit_tokens == 0 and b.stats.computed_tokens == 4 * BS + 1   # nothing served
    plan = b.build([("b", None, False, 4 * BS + 1)])   # vLLM recomputes from block 0
    assert [k for k, _ in plan.saves] == keys and [blk for _, blk in plan.shared_saves] == [5, 6, 7, 8]
    step(b_store, plan)
    b_store._writer.submit(lambda: None).result()
    assert SharedBlocks(tmp_path, [IDENT]).prefix(hashes) == 4


def test_a_failed_disk_write_raises_nothing_and_its_load_fails_later(tmp_path):
    store, p = BlockStore(tmp_path / "d"), pages(1)
    store.register(p, BLOCKS)
    store.save(7, 0)
    store.save(8, 1)
    shutil.rmtree(tmp_path / "d")         # a tmp cleaner, an unmounted volume, a full disk
    store.move("disk", 7)
    store.move("disk", 8)
    assert store.stats.write_failed == 2 and store.stats.files_written == 0
    assert 7 not in store.ram and 7 not in store.disk
    assert not store.load(7, 3) and store.failed == {3}
    store.move("drop", 8)                 # nothing held: nothing to do, no error


def test_keys_computed_after_the_failed_plan_are_owed_too(tmp_path):
    """With async scheduling vLLM may run the request's next chunk before the failure is
    reported: the blocks of that chunk were computed from the bad block as well."""
    sh, store, p = first_request(tmp_path)
    sh.match("b", [1, 2, 3, 4, 5], 5 * BS + 1, 0, parse_hints(None))
    sh.allocated("b", 0, 3 * BS)
    plan = sh.build([("b", [4, 5, 6], True, 3 * BS)])                  # chunk 1: the loads only
    assert plan.chains == [[4, 5, 6]]
    plan = sh.build([("b", [7, 8, 9], False, 5 * BS + 1)])             # chunk 2, already scheduled
    assert [k for k, _ in plan.saves] == [4, 5] and plan.chains == []
    sh.load_failed({5})                                                 # chunk 1's report arrives
    assert sh.owed == {2, 3, 4, 5}
    plan = sh.build([("b", None, False, 5 * BS + 1)])                  # vLLM recomputes from block 5
    assert sorted(plan.saves) == [(2, 5), (3, 6), (4, 7), (5, 8)] and not sh.owed
