"""Shared KV tier: a directory (`pbkv.engine.shared_kv.SharedKVDir`) vs Ray's object store.

One writer process puts N blocks, then one reader process gets them all; per-block latency (p50,
p99) and throughput are printed for each block shape and each medium:

    PYTHONPATH=src python benchmarks/shared_tier.py --blocks 200 [--no-ray]

Block shapes ([layers, 2, kv_heads, 16 tokens, head_dim]): the tiny test model (2x2x2x16x16 fp32,
8 KiB) and a SmolLM2-135M block (30x2x3x16x64, fp16 360 KiB and fp32 720 KiB).
- directory: `put` = write a temp file + rename (+ sha256 of the tensor); `get` = read the file,
  parse, check sha256 and key. Same machine, so reads come from the page cache (a network file
  system would add its own latency);
- Ray: `ray.put` of a numpy array in a writer actor (the writer owns the objects), `ray.get` of
  the refs in a reader actor (zero-copy from the node's shared-memory store; no checksum), then
  `torch.from_numpy`. Local Ray (`address="local"`), its own temp dir and namespace.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import numpy as np
import torch

SHAPES = {"tiny fp32": ((2, 2, 2, 16, 16), torch.float32),
          "smollm2 fp16": ((30, 2, 3, 16, 64), torch.float16),
          "smollm2 fp32": ((30, 2, 3, 16, 64), torch.float32)}


def blocks(shape, dtype, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def summary(seconds: list[float], nbytes: int) -> str:
    s = sorted(seconds)
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
    return (f"p50 {statistics.median(s) * 1e3:7.3f} ms  p99 {p99 * 1e3:7.3f} ms  "
            f"{nbytes * len(s) / sum(s) / 1e6:8.1f} MB/s")


# ---------------------------------------------------------------------------- directory

def _dir_writer(directory: str, shape, dtype, n: int, out) -> None:
    from pbkv.engine.shared_kv import SharedKVDir
    d = SharedKVDir(directory, "bench", 1 << 40)
    times = []
    for i, kv in enumerate(blocks(shape, dtype, n)):
        t = time.perf_counter()
        d.put(i, kv)
        times.append(time.perf_counter() - t)
    out.put(times)


def _dir_reader(directory: str, n: int, out) -> None:
    from pbkv.engine.shared_kv import SharedKVDir
    d = SharedKVDir(directory, "bench", 1 << 40)
    times = []
    for i in range(n):
        t = time.perf_counter()
        kv = d.get(i)
        times.append(time.perf_counter() - t)
        assert kv is not None
    out.put(times)


def directory(shape, dtype, n: int) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pbkv-bench-shared-") as tmp:
        res = []
        for target, args in ((_dir_writer, (tmp, shape, dtype, n)), (_dir_reader, (tmp, n))):
            q = ctx.Queue()
            p = ctx.Process(target=target, args=(*args, q))
            p.start()
            res.append(q.get())
            p.join()
    return res[0], res[1]


# ---------------------------------------------------------------------------- Ray object store

def ray_store(cases: dict, n: int) -> dict[str, tuple[list[float], list[float]]]:
    import ray

    @ray.remote(num_cpus=0)
    class Writer:
        def put(self, shape, dtype, n):
            refs, times = [], []
            for kv in blocks(shape, dtype, n):
                arr = kv.numpy()
                t = time.perf_counter()
                refs.append(ray.put(arr))
                times.append(time.perf_counter() - t)
            self.refs = refs   # the writer owns them: they live as long as it does
            return [refs], times

    @ray.remote(num_cpus=0)
    class Reader:
        def get(self, wrapped):
            times = []
            for ref in wrapped[0]:
                t = time.perf_counter()
                kv = torch.from_numpy(ray.get(ref))
                times.append(time.perf_counter() - t)
                assert kv.numel() > 0
            return times

    tmp = tempfile.mkdtemp(prefix="pbkv-ray-")
    ray.init(address="local", namespace="pbkv-bench-shared", num_cpus=2, include_dashboard=False,
             _temp_dir=tmp, log_to_driver=False, object_store_memory=512 << 20)
    try:
        w, r = Writer.remote(), Reader.remote()
        out = {}
        for name, (shape, dtype) in cases.items():
            wrapped, put_times = ray.get(w.put.remote(shape, dtype, n))
            out[name] = (put_times, ray.get(r.get.remote(wrapped)))
        return out
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (shape, dtype) in SHAPES.items():
        nbytes = int(np.prod(shape)) * torch.finfo(dtype).bits // 8
        put, get = directory(shape, dtype, args.blocks)
        rows.append((name, nbytes, "directory", put, get))
    if not args.no_ray:
        for name, (put, get) in ray_store(SHAPES, args.blocks).items():
            shape, dtype = SHAPES[name]
            rows.append((name, int(np.prod(shape)) * torch.finfo(dtype).bits // 8, "ray", put, get))
    for name, nbytes, medium, put, get in sorted(rows, key=lambda r: (list(SHAPES).index(r[0]), r[2])):
        print(f"{name:13s} {nbytes / 1024:6.0f} KiB  {medium:9s}  put {summary(put, nbytes)}  |  "
              f"get {summary(get, nbytes)}")


if __name__ == "__main__":
    main()
