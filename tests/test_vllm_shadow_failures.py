"""Failed writes in the vLLM connector's store, without vLLM."""

import shutil

import torch

from pbkv.integrations.vllm.store import BlockStore

BS = 4
BLOCKS = 16


def pages(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, BS, 8, generator=g) for i in range(2)}


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
