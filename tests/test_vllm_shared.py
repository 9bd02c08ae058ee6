"""The vLLM connector's shared tier without vLLM: stable-key rules, and two instances (scheduler
spine + worker store each) exchanging blocks through one directory."""

import hashlib

import pytest
import torch

from pbkv.cache import Capacities
from pbkv.integrations.vllm.hints import parse_hints
from pbkv.integrations.vllm.shadow import Shadow
from pbkv.integrations.vllm.shared import SharedBlocks, instance_identity, key_problem
from pbkv.integrations.vllm.store import BlockStore

BS, BLOCKS = 4, 16
IDENT = instance_identity("org/model", None, "float32", "auto", BS, "sha256", 0, 1)


def test_keys_are_shared_only_when_vllm_hashes_are_stable():
    assert "PYTHONHASHSEED is not set" in key_problem("sha256", {}, fixed_default_seed=False)
    assert key_problem("sha256", {}, fixed_default_seed=True) is None     # vllm 0.32: a fixed seed
    for fixed in (False, True):
        assert "not collision-resistant" in key_problem("xxhash", {"PYTHONHASHSEED": "0"}, fixed)
        assert key_problem("sha256_cbor", {"PYTHONHASHSEED": "0"}, fixed) is None
        assert key_problem("sha256", {"PYTHONHASHSEED": "random"}, fixed) is None   # vLLM hashes the string
    other = {instance_identity("org/model", None, "float32", "auto", BS, "sha256", 1, 2),
             instance_identity("org/model", None, "float32", "auto", BS, "sha256_cbor", 0, 1),
             instance_identity("org/model", "v2", "float32", "auto", BS, "sha256", 0, 1),
             instance_identity("org/model", None, "bfloat16", "auto", BS, "sha256", 0, 1),
             instance_identity("org/model", None, "float32", "auto", BS, "sha256", 0, 1, config="rope 100")}
    assert IDENT not in other and len(other) == 5


def chain(tokens_per_block: list[int]) -> list[bytes]:
    """Stand-ins for vLLM's chained block hashes (32 bytes, each naming its whole prefix)."""
    out, prev = [], b"seed"
    for t in tokens_per_block:
        prev = hashlib.sha256(prev + bytes([t])).digest()
        out.append(prev)
    return out


def key(h: bytes) -> int:
    return int.from_bytes(h[:8], "little") >> 1   # the connector's `block_key`


class Instance:
    """One vLLM instance as the connector sees it: the scheduler's spine and rank 0's store."""

    def __init__(self, directory, seed: int):
        self.shadow = Shadow(BS, Capacities(64, 0, 0), shared=SharedBlocks(directory, [IDENT]))
        self.store = BlockStore(None, shared=SharedBlocks(directory, [IDENT]))
        g = torch.Generator().manual_seed(seed)
        self.pages = {f"layer{i}": torch.randn(BLOCKS, 2, BS, 2, 8, generator=g) for i in range(2)}
        self.store.register(self.pages, BLOCKS)

    def request(self, rid, hashes, prompt, blocks):
        """vLLM's scheduler calls for one request, then the worker executing the plan."""
        ext = self.shadow.match(rid, [key(h) for h in hashes], prompt, 0, parse_hints({"workflow_id": rid}),
                                hashes=hashes)
        self.shadow.allocated(rid, 0, ext)
        plan = self.shadow.build([(rid, blocks, True, prompt)])
        for h, b in plan.shared_loads:
            self.store.load_shared(h, b)
        for h, b in plan.shared_saves:
            self.store.save_shared(h, b)
        self.store._writer.submit(lambda: None).result()   # the writer thread has caught up
        self.shadow.finished(rid)
        return ext, plan

    def block(self, block_id):
        return torch.stack([t[block_id] for t in self.pages.values()])


def test_instance_b_loads_the_blocks_instance_a_computed(tmp_path):
    a, b = Instance(tmp_path, 1), Instance(tmp_path, 2)
    hashes = chain([1, 2, 3, 4])
    ext, plan = a.request("r1", hashes, 4 * BS + 1, [0, 1, 2, 3, 4])
    assert ext == 0 and [blk for _, blk in plan.shared_saves] == [0, 1, 2, 3]
    ext, plan = b.request("r2", hashes[:3] + chain([9]), 4 * BS + 1, [5, 6, 7, 8, 9])
    assert ext == 3 * BS and plan.shared_loads == [(hashes[i], 5 + i) for i in range(3)]
    for i in range(3):
        assert torch.equal(b.block(5 + i), a.block(i))
    assert b.shadow.stats.shared_hit_tokens == 3 * BS and b.store.stats.loaded_shared_blocks == 3
    assert [blk for _, blk in plan.shared_saves] == [8]     # only the block B computed itself


def test_a_corrupt_shared_block_fails_its_load_so_vllm_recomputes_it(tmp_path):
    a, b = Instance(tmp_path, 1), Instance(tmp_path, 2)
    hashes = chain([1, 2, 3])
    a.request("r1", hashes, 3 * BS + 1, [0, 1, 2, 3])
    path = SharedBlocks(tmp_path, [IDENT]).dirs[0].path(int.from_bytes(hashes[1], "big"))
    raw = path.read_bytes()
    path.write_bytes(raw[:-4] + bytes(x ^ 1 for x in raw[-4:]))
    b.shadow.match("r2", [key(h) for h in hashes], 3 * BS + 1, 0, parse_hints(None), hashes=hashes)
    b.shadow.allocated("r2", 0, 3 * BS)
    plan = b.shadow.build([("r2", [4, 5, 6, 7], True, 3 * BS + 1)])
    results = [b.store.load_shared(h, blk) for h, blk in plan.shared_loads]
    assert results == [True, False, True] and b.store.stats.shared_failed == 1
    assert b.store.failed == {5} and not path.exists()   # reported to vLLM; the bad file is gone


@pytest.mark.parametrize("algo, env", [("xxhash_cbor", {}), ("xxhash", {"PYTHONHASHSEED": "0"}), ("sha256", {})])
def test_key_problem_names_the_fix(algo, env):
    problem = key_problem(algo, env, fixed_default_seed=False)
    assert "PYTHONHASHSEED=0" in problem or "use sha256 or sha256_cbor" in problem


def test_a_shared_block_of_another_dtype_is_a_miss_never_a_cast(tmp_path):
    b = Instance(tmp_path, 2)
    h = chain([1])[0]
    shape = b.block(0).shape
    assert SharedBlocks(tmp_path, [IDENT]).put(h, torch.ones(shape, dtype=torch.float64))   # right shape, wrong dtype
    before = b.block(3).clone()
    assert b.store.load_shared(h, 3) is False
    assert b.store.failed == {3} and b.store.stats.shared_failed == 1 and b.store.stats.loaded_shared_blocks == 0
    assert torch.equal(b.block(3), before)   # vLLM recomputes the block; nothing was copied in
    assert not SharedBlocks(tmp_path, [IDENT]).dirs[0].path(int.from_bytes(h, "big")).exists()  # removed: rewritable
    assert SharedBlocks(tmp_path, [IDENT]).put(h, torch.ones(shape, dtype=torch.float32))
    assert b.store.load_shared(h, 3) is True and torch.equal(b.block(3), torch.ones(shape))
