"""The pbkv connector, GPU steer and offload policy against vLLM's real interfaces (fast, no engine).

Skipped where vLLM is not importable (the main venv); `.ci/run` runs them in .venv-vllm."""

import json
import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (its tests run in .venv-vllm: see .ci/run)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus  # noqa: E402

from pbkv.integrations.vllm import kv_transfer_config  # noqa: E402
from pbkv.integrations.vllm.connector import PBKVConnector, PBKVMeta, block_key  # noqa: E402
from pbkv.integrations.vllm.gpu_pool import GPUSteer  # noqa: E402
from pbkv.integrations.vllm.offload_policy import PBKVCachePolicy  # noqa: E402
from pbkv.integrations.vllm.shadow import Stats  # noqa: E402

BS = 32


def make(role, **extra):
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv_transfer_config("lru", **extra)),
                          cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(rank=0))
    return PBKVConnector(cfg, role, SimpleNamespace(num_blocks=16))


def request(rid, n_blocks, params=None, prompt=None):
    hashes = [bytes([ord(rid[0]), i]) * 16 for i in range(n_blocks)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, kv_transfer_params=params,
                           num_prompt_tokens=prompt or n_blocks * BS + 1)


def sched_output(new=(), n=()):
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                                               for r, b, c in new],
                           scheduled_cached_reqs=cached, num_scheduled_tokens=dict(n))


def test_is_a_vllm_connector_with_the_documented_config():
    assert issubclass(PBKVConnector, KVConnectorBase_V1)
    cfg = KVTransferConfig(**kv_transfer_config("pbkv", predictor_dir="m"))
    assert cfg.kv_connector_module_path == "pbkv.integrations.vllm.connector"


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_bad_extra_config_is_refused_at_start_in_every_role(role):
    """The checks of `pbkv.integrations.vllm.config` (tested in full in tests/test_vllm_config.py)."""
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.steer_gpu='false'"):
        make(role, steer_gpu="false")
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.host_token \(did you mean 'host_tokens'"):
        make(role, host_token=5)


def test_steer_gpu_false_binds_no_steer():
    c = make(KVConnectorRole.SCHEDULER, steer_gpu=False)
    c.bind_gpu_block_pool(object())
    assert c._pool is None and c.config.steer_gpu is False


def test_scheduler_saves_then_offers_the_prefix():
    c = make(KVConnectorRole.SCHEDULER, host_tokens=1024)
    r = request("a", 3)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, None, 0)
    meta = c.build_connector_meta(sched_output([("a", [4, 5, 6, 7], 0)], {"a": 3 * BS + 1}))
    assert isinstance(meta, PBKVMeta) and meta.plan.saves == [(block_key(h), b) for h, b in zip(r.block_hashes, [4, 5, 6])]
    c.request_finished(r, [4, 5, 6, 7])
    r2 = request("a", 3)
    r2.request_id = "b"
    assert c.get_num_new_matched_tokens(r2, BS) == (2 * BS, False)   # vLLM had one block itself
    c.update_state_after_alloc(r2, None, 2 * BS)
    meta = c.build_connector_meta(sched_output([("b", [9, 10, 11, 12], 3 * BS)], {"b": 1}))
    assert [b for _, b in meta.plan.loads] == [10, 11]
    assert c.stats()["host_hit_tokens"] == 2 * BS and c.stats()["gpu_hit_tokens"] == BS


def test_worker_executes_a_plan(tmp_path):
    import torch
    w = make(KVConnectorRole.WORKER, disk_dir=str(tmp_path))
    caches = {"l0": torch.randn(16, 2, BS, 8), "l1": torch.randn(16, 2, BS, 8)}
    w.register_kv_caches(caches)
    s = make(KVConnectorRole.SCHEDULER)
    r = request("x", 1)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, None, 0)
    w.bind_connector_metadata(s.build_connector_meta(sched_output([("x", [3, 4], 0)], {"x": BS + 1})))
    w.start_load_kv(None)
    w.wait_for_save()
    w.clear_connector_metadata()
    before = caches["l0"][3].clone()
    caches["l0"][7].zero_()
    w.store.load(block_key(r.block_hashes[0]), 7)
    assert torch.equal(caches["l0"][7], before) and w.get_block_ids_with_load_errors() == set()


def test_gpu_steer_sends_demoted_blocks_to_the_head_of_the_free_queue():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(3)
    hashes = [b"h0" * 16, b"h1" * 16, b"h2" * 16]
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    for b, h in zip(blocks, hashes):   # what cache_full_blocks does for a computed block
        pool._insert_block_hash(make_block_hash_with_group_id(h, 0), b, BS)
    cached = [pool.get_cached_block(h, [0]) for h in hashes]
    if not all(cached):
        pytest.skip("this vLLM's BlockPool caches blocks through another path")
    pool.free_blocks(blocks)
    stats = Stats()
    steer = GPUSteer(pool, stats)
    keys = [block_key(h) for h in hashes]
    steer.remember(keys, hashes)
    steer.demote([keys[2]])
    assert stats.gpu_demoted_blocks == 1
    assert pool.get_cached_block(hashes[2], [0]) is None
    assert pool.free_block_queue.get_all_free_blocks()[0] is blocks[2]


def ctx(wf=None, done=False):
    params = {"workflow_id": wf, "workflow_done": done} if wf else None
    return SimpleNamespace(kv_transfer_params=params)


def chunk(ref=0):
    c = ChunkStatus(0)
    c.ref_cnt = ref
    return c


def test_offload_policy_is_a_cache_policy_retired_first_and_atomic():
    assert issubclass(PBKVCachePolicy, CachePolicy)
    p = PBKVCachePolicy(8)
    for k in (b"a", b"b", b"c", b"d"):
        p.insert(k, chunk())
    p.on_request_finished([[b"a"]], set(), set(), ctx("w1", done=True))   # a: retired
    p.on_request_finished([[b"b"]], set(), set(), ctx("w2"))              # b: live workflow
    p.touch([b"c"], ctx())                                                 # c, d: unhinted, LRU
    assert [k for k, _ in p.evict(2, set())] == [b"a", b"d"]
    assert p.evict(3, set()) is None and set(p.chunks) == {b"b", b"c"}   # atomic
    assert [k for k, _ in p.evict(1, {b"c"})] == [b"b"]                  # protected skipped
    p.chunks[b"c"].ref_cnt = 1
    assert p.evict(1, set()) is None                                     # pinned never evicted


# ---------------------------------------------------------------- the shared tier between instances

HASH_PROBE = ("from vllm.utils.hashing import get_hash_fn_by_name; from vllm.v1.core import kv_cache_utils as k; "
              "f = get_hash_fn_by_name('{algo}'); k.init_none_hash(f); "
              "print(k.hash_block_tokens(f, None, [1, 2, 3]).hex())")


@pytest.mark.parametrize("env", [{}, {"PYTHONHASHSEED": "7"}])
def test_vllm_block_hashes_agree_between_processes_with_sha256(env):
    """What the shared tier's keys rest on, checked against the installed vLLM itself."""
    import os
    import subprocess
    import sys
    base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    outs = {subprocess.run([sys.executable, "-c", HASH_PROBE.format(algo="sha256")], env={**base, **env},
                           capture_output=True, text=True, check=True).stdout.strip() for _ in range(2)}
    assert len(outs) == 1
    from pbkv.integrations.vllm.shared import key_problem
    from vllm.v1.core import kv_cache_utils
    assert key_problem("sha256", env, hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED")) is None


def make_shared(role, directory, algo="sha256"):
    cfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(**kv_transfer_config("lru", shared_dir=str(directory))),
        cache_config=SimpleNamespace(block_size=BS, prefix_caching_hash_algo=algo, cache_dtype="auto"),
        model_config=SimpleNamespace(model="org/model", revision=None, dtype="float32"),
        parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1))
    return PBKVConnector(cfg, role, SimpleNamespace(num_blocks=16))


def test_two_instances_share_blocks_through_shared_dir(tmp_path):
    import torch
    pages = {}
    instances = []
    for name in "ab":
        s, w = make_shared(KVConnectorRole.SCHEDULER, tmp_path), make_shared(KVConnectorRole.WORKER, tmp_path)
        pages[name] = {"l0": torch.randn(16, 2, BS, 8), "l1": torch.randn(16, 2, BS, 8)}
        w.register_kv_caches(pages[name])
        instances.append((s, w))

    def step(s, w, rid, local, blocks, computed, scheduled):
        r = request("x", 3)
        r.request_id = rid
        ext, _ = s.get_num_new_matched_tokens(r, local)
        s.update_state_after_alloc(r, None, ext)
        w.bind_connector_metadata(s.build_connector_meta(sched_output([(rid, blocks, computed)], {rid: scheduled})))
        w.start_load_kv(None)
        w.wait_for_save()
        w.clear_connector_metadata()
        w.store._writer.submit(lambda: None).result()
        s.request_finished(r, blocks)
        return ext

    (sa, wa), (sb, wb) = instances
    assert step(sa, wa, "r1", 0, [0, 1, 2, 3], 0, 3 * BS + 1) == 0
    assert step(sb, wb, "r2", 0, [5, 6, 7, 8], 3 * BS, 1) == 3 * BS      # all three from A's files
    for i in range(3):
        for layer in ("l0", "l1"):
            assert torch.equal(pages["b"][layer][5 + i], pages["a"][layer][i])
    assert sb.stats()["shared_hit_tokens"] == 3 * BS and wb.store.stats.loaded_shared_blocks == 3
    assert wa.store.stats.shared_queued == 3 and wb.store.stats.shared_queued == 0


def test_shared_dir_with_an_unshareable_hash_is_refused(tmp_path):
    with pytest.raises(ValueError, match="shared_dir .* refused: prefix_caching_hash_algo 'xxhash'"):
        make_shared(KVConnectorRole.SCHEDULER, tmp_path, algo="xxhash")


def test_failed_loads_reach_the_shadow_through_update_connector_output(tmp_path):
    """vLLM hands the worker's `get_block_ids_with_load_errors` to the scheduler's connector as
    `KVConnectorOutput.invalid_block_ids`; the keys from the failed block on are then owed."""
    from vllm.v1.outputs import KVConnectorOutput
    import torch
    s, w = make(KVConnectorRole.SCHEDULER, host_tokens=1024), make(KVConnectorRole.WORKER, disk_dir=str(tmp_path))
    w.register_kv_caches({"l0": torch.randn(16, 2, BS, 8)})
    r = request("a", 3)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, None, 0)
    s.build_connector_meta(sched_output([("a", [4, 5, 6, 7], 0)], {"a": 3 * BS + 1}))
    s.request_finished(r, [4, 5, 6, 7])
    r2 = request("a", 3)
    r2.request_id = "b"
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, None, 3 * BS)
    w.bind_connector_metadata(s.build_connector_meta(sched_output([("b", [9, 10, 11, 12], 0)], {"b": 3 * BS + 1})))
    w.start_load_kv(None)      # the worker never saw "a": every load fails
    w.wait_for_save()
    failed = w.get_block_ids_with_load_errors()
    assert failed == {9, 10, 11} and not w.store.ram
    s.update_connector_output(KVConnectorOutput(invalid_block_ids=failed, kv_connector_stats=w.get_kv_connector_stats()))
    assert s.shadow.owed == {block_key(h) for h in r.block_hashes} and s.stats()["load_failed_blocks"] == 3
    assert s.get_num_new_matched_tokens(request("a", 3), 0) == (0, False)   # no key offered while owed
    # the worker's own counters reach the scheduler's stats (before: they stayed in the worker)
    assert s.stats()["worker"]["load_failed"] == 3 and s.stats()["worker"]["missing"] == 3
    assert w.get_kv_connector_stats() is None   # sent once: nothing new since
    assert PBKVConnector.build_kv_connector_stats({"load_failed": 2}).aggregate(
        PBKVConnector.build_kv_connector_stats({"load_failed": 1})).reduce() == {"load_failed": 3}


def test_worker_counters_rewrite_the_stats_file_only_on_a_failure_or_when_idle(tmp_path):
    """Before: every step whose worker saved a block rewrote the stats file (a file write per step
    on the scheduler's hot path); now only a failure, or gains with no request left, write it."""
    from vllm.v1.outputs import KVConnectorOutput
    path = tmp_path / "s.json"
    s = make(KVConnectorRole.SCHEDULER, stats_path=str(path))
    r = request("a", 2)
    s.get_num_new_matched_tokens(r, 0)
    gains = lambda **data: KVConnectorOutput(kv_connector_stats=PBKVConnector.build_kv_connector_stats(data))
    s.update_connector_output(gains(saved_blocks=3))
    assert not path.exists()                                   # a request runs: at its end
    s.update_connector_output(gains(write_failed=1))
    assert json.loads(path.read_text())["worker"] == {**json.loads(path.read_text())["worker"],
                                                      "saved_blocks": 3, "write_failed": 1}
    s.request_finished(r, [])
    s.update_connector_output(gains(saved_blocks=2))          # the last step's saves, after its end
    assert json.loads(path.read_text())["worker"]["saved_blocks"] == 5


def test_stats_path_write_failures_never_reach_vllm(tmp_path, caplog):
    d = tmp_path / "stats"
    d.mkdir()
    c = make(KVConnectorRole.SCHEDULER, stats_path=str(d / "s.json"))
    c.request_finished(request("a", 1), [])
    assert json.loads((d / "s.json").read_text())["requests"] == 0 and os.listdir(d) == ["s.json"]
    d.rename(tmp_path / "gone")
    with caplog.at_level("WARNING", logger="pbkv.vllm"):
        c.request_finished(request("b", 1), [])
        c.request_finished(request("c", 1), [])
    assert len([m for m in caplog.messages if "stats_path" in m]) == 1


def test_the_helper_recomputes_failed_loads_and_fail_is_warned_about(caplog):
    assert KVTransferConfig(**kv_transfer_config("lru")).kv_load_failure_policy == "recompute"
    with caplog.at_level("WARNING", logger="pbkv.vllm"):
        make(KVConnectorRole.SCHEDULER)
        assert not [m for m in caplog.messages if "kv_load_failure_policy" in m]
        cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(**{**kv_transfer_config("lru"),
                                                                     "kv_load_failure_policy": "fail"}),
                              cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(rank=0))
        PBKVConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=16))
    assert [m for m in caplog.messages if "kv_load_failure_policy is 'fail'" in m]


def test_a_predictor_dir_the_policy_does_not_read_is_refused(tmp_path):
    """Loaded and silently unused before: the figures would read as a predicting policy's."""
    with pytest.raises(ValueError, match=r"predictor_dir='.*' given, but kv_connector_extra_config.policy='lru' "
                                         r"reads no trained predictor \(policies that do: pbkv, "):
        make(KVConnectorRole.SCHEDULER, predictor_dir=str(tmp_path))
