"""The vLLM connector's scheduler-side spine and worker store, without vLLM (pure pbkv + torch)."""

import torch

from pbkv.cache import Capacities, Tier
from pbkv.integrations.vllm.hints import DEFAULT_AGENT, parse_hints
from pbkv.integrations.vllm.shadow import Shadow
from pbkv.integrations.vllm.store import BlockStore

BS = 4


def run_request(sh, rid, keys, prompt, hints=None, local=0, blocks=None):
    """Drive one request through the scheduler calls vLLM makes; return (external tokens, plan)."""
    h = parse_hints(hints)
    ext = sh.match(rid, keys, prompt, local, h)
    sh.allocated(rid, local, ext)
    blocks = blocks if blocks is not None else list(range(100, 100 + len(keys) + 1))
    plan = sh.build([(rid, blocks, True, prompt)])
    return ext, plan


def test_hints_parse_and_defaults():
    assert parse_hints(None).workflow_id is None and parse_hints(None).done
    h = parse_hints({"workflow_id": "t1", "agent": "planner"})
    assert (h.workflow_id, h.agent, h.done) == ("t1", "planner", False)
    assert parse_hints({"workflow_id": 7, "workflow_done": True}).done
    assert parse_hints({"workflow_id": "", "agent": True}).agent == DEFAULT_AGENT   # malformed: ignored


def test_save_then_load_from_host():
    sh = Shadow(BS, Capacities(12, 64, 0))
    keys = [11, 12, 13]
    ext, plan = run_request(sh, "a", keys, 13, {"workflow_id": "w"})
    assert ext == 0 and [k for k, _ in plan.saves] == keys
    sh.finished("a")
    # the device model holds 8 tokens: the next request evicts the first prefix down to host
    ext2, plan2 = run_request(sh, "b", [21, 22, 23], 13, {"workflow_id": "w"})
    sh.finished("b")
    ext3, plan3 = run_request(sh, "c", keys + [14], 17, {"workflow_id": "w"})
    assert ext3 == 3 * BS
    assert [k for k, _ in plan3.loads] == keys
    assert sh.stats.host_hit_tokens == 3 * BS
    sh.cache.check()


def test_last_prompt_token_never_loaded():
    sh = Shadow(BS, Capacities(64, 64, 0))
    run_request(sh, "a", [1, 2], 8)
    sh.finished("a")
    ext = sh.match("b", [1, 2], 8, 0, parse_hints(None))
    assert ext == BS   # 8 tokens = 2 full blocks, but the last token must be computed


def test_pending_save_is_locked_until_next_plan():
    sh = Shadow(BS, Capacities(8, 0, 0))
    _, plan = run_request(sh, "a", [1, 2], 8)
    sh.finished("a")
    assert not sh.cache.make_room(Tier.DEVICE, 8)     # still pinned: its save runs this step
    sh.build([])
    assert sh.cache.make_room(Tier.DEVICE, 8)
    sh.cache.check()


def test_retired_first_with_workflow_done():
    sh = Shadow(BS, Capacities(16, 0, 0), policy="pbkv-retired")
    run_request(sh, "a", [1, 2], 9, {"workflow_id": "old", "workflow_done": True})
    sh.finished("a")
    run_request(sh, "b", [5, 6], 9, {"workflow_id": "live"})
    sh.finished("b")
    sh.build([])
    order = sh.cache.candidates(Tier.DEVICE)
    assert order[0].blocks == [1, 2]   # the ended workflow's cache goes first although older... and retired


def test_disk_tier_moves_and_gpu_demotions_become_ops():
    sh = Shadow(BS, Capacities(8, 8, 64))
    demoted = []
    sh.ops.on_device_evict = demoted.extend
    moves = []
    for rid, keys in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        moves += run_request(sh, rid, keys, 9)[1].moves
        sh.finished(rid)
    moves += sh.build([]).moves
    assert ("disk", 1) in moves and ("disk", 2) in moves
    assert demoted[:2] == [1, 2]
    ext, plan = run_request(sh, "d", [1, 2, 7], 13)
    assert ext == 8 and ("host", 1) in plan.moves   # disk -> RAM mirror as it returns to the GPU model
    assert sh.stats.disk_hit_tokens == 8
    sh.cache.check()


def paged(num_blocks=6, dim=0):
    shape = [num_blocks, 2, BS, 8] if dim == 0 else [2, num_blocks, BS, 8]
    return {f"l{i}": torch.zeros(shape) for i in range(3)}


def test_store_roundtrip_ram_and_disk(tmp_path):
    for dim in (0, 1):
        src, dst = paged(dim=dim), paged(dim=dim)
        for t in src.values():
            t.normal_()
        a, b = BlockStore(tmp_path / f"d{dim}"), None
        a.register(src, 6)
        a.save(42, 3)
        a.move("disk", 42)
        assert 42 not in a.ram and a.stats.files_written == 1
        a.register(dst, 6)
        assert a.load(42, 1)
        for name in src:
            assert torch.equal(src[name].select(dim, 3), dst[name].select(dim, 1))
        a.move("host", 42)
        assert 42 in a.ram and not list((tmp_path / f"d{dim}").iterdir())
        del b


def test_store_corrupt_file_is_never_served(tmp_path):
    src = paged()
    s = BlockStore(tmp_path)
    s.register(src, 6)
    s.save(7, 2)
    s.move("disk", 7)
    path = next(tmp_path.iterdir())
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not s.load(7, 0)
    assert s.failed == {0} and s.stats.corrupt == 1


def test_new_blocks_never_evict_their_own_prefix():
    sh = Shadow(BS, Capacities(12, 64, 0))
    run_request(sh, "a", [1, 2], 9)
    sh.finished("a")
    sh.build([])
    # vLLM itself still had blocks 1, 2 (a local hit): the request extends them by one block while
    # the device model is full; the prefix must stay on the device under its new child
    sh.match("b", [1, 2, 3], 13, 8, parse_hints(None))
    sh.allocated("b", 8, 0)
    sh.build([("b", [100, 101, 102, 103], True, 13)])
    sh.cache.check()


def test_store_counts_each_load_by_the_tier_its_kv_came_from(tmp_path):
    """A disk hit is planned as a ("host", key) move (file -> RAM) then a load from RAM: the load
    counts as a disk load, as the shadow counts it in disk_hit_tokens (not as a RAM load)."""
    sh = Shadow(BS, Capacities(8, 8, 64))
    st = BlockStore(tmp_path)
    st.register(paged(num_blocks=110), 110)

    def step(plan):
        st.before_forward(plan)
        st.after_forward(plan)

    for rid, keys in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        step(run_request(sh, rid, keys, 9)[1])
        sh.finished(rid)
    step(sh.build([]))
    ext, plan = run_request(sh, "d", [1, 2, 7], 13)   # 1, 2 come back from disk
    assert ("host", 1) in plan.moves and [k for k, _ in plan.loads] == [1, 2]
    step(plan)
    sh.finished("d")
    ext, plan = run_request(sh, "e", [5, 6, 8], 13)   # 5, 6 from RAM
    step(plan)
    s = sh.stats
    assert s.disk_hit_tokens == 8 and s.host_hit_tokens == 8, s
    assert st.stats.loaded_disk_blocks * BS == s.disk_hit_tokens, st.stats
    assert st.stats.loaded_ram_blocks * BS == s.host_hit_tokens, st.stats
    assert st.stats.missing == st.stats.corrupt == st.stats.load_failed == 0


def test_store_a_promotion_counts_only_for_its_own_steps_first_load(tmp_path):
    from pbkv.integrations.vllm.plan import Plan
    st = BlockStore(tmp_path)
    st.register(paged(), 6)
    st.save(7, 2)
    st.move("disk", 7)
    st.before_forward(Plan(moves=[("host", 7)], loads=[(7, 0), (7, 1)]))
    assert (st.stats.loaded_disk_blocks, st.stats.loaded_ram_blocks) == (1, 1)
    st.before_forward(Plan(loads=[(7, 3)]))    # a later step: the block is in RAM now
    assert (st.stats.loaded_disk_blocks, st.stats.loaded_ram_blocks) == (1, 2)
    st.save(8, 2)
    st.move("disk", 8)
    st.before_forward(Plan(moves=[("host", 8)]))   # promoted without a load (a prefix vLLM holds)
    st.before_forward(Plan(loads=[(8, 0)]))
    assert (st.stats.loaded_disk_blocks, st.stats.loaded_ram_blocks) == (1, 3)


def test_store_a_missing_block_is_missing_not_corrupt(tmp_path):
    from pbkv.integrations.vllm.plan import Plan
    st = BlockStore(tmp_path)
    st.register(paged(), 6)
    st.before_forward(Plan(moves=[("host", 11)], loads=[(12, 3)]))   # never written
    assert (st.stats.missing, st.stats.corrupt, st.stats.load_failed) == (2, 0, 1)
    assert st.failed == {3}
