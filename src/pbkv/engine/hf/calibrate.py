"""`pbkv calibrate`: measure the real engine on this machine and write a simulator profile.

Measured (best of `repeats` runs each, one process, the torch thread count as set):
- prefill seconds for new tokens x cached-prefix tokens; fitted by least squares as
  overhead + FLOPs / rate with the cost model's FLOPs (2 x params x new + attention), which gives
  `step_overhead_ms` and an effective FLOP rate (`gpu.tflops`, with `prefill_mfu` = 1); noise that
  makes that fit meaningless (slope <= 0, intercept < 0) refits it through the origin (`fit_prefill`),
  and a fit off by more than MISFIT_WARN on a run adds a warning to the profile's sources;
- one decode step of one request at a short and a long context. The real engine decodes running
  requests one after another (a forward, with its fixed cost, per request), so its step is batch x
  one request's fixed cost + the KV of every running context: the two measurements give that
  fixed cost (`decode_request_ms`, which puts the simulator in its per-request decode mode) and
  the cost per context token (`hbm_gbps` = KV bytes per token / it; `decode_bw_eff` = 1);
- host copy (a RAM tensor copy: the host->device "link" of a CPU run) bandwidth and latency ->
  `pcie_gbps` (`pcie_eff` = 1), `load_latency_ms`;
- disk read of a KV file as the store reads it (file read, safetensors parse, sha256) ->
  `disk_gbps`, `disk_latency_ms`.
The real engine prefills one request per pass (`max_prefill_tokens` = 1 makes the simulator do
the same). `memory_gib` is set so that the profile's default device capacity is
`device_tokens` KV tokens (pass `--device-tokens` to a run to choose another).
"""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from pbkv.engine.hf.kvstore import tensor_sha256
from pbkv.engine.hf.model import LoadedModel, cache_to_kv, forward, make_cache

GIB = 1024 ** 3
MISFIT_WARN = 0.5  # the profile's sources carry a warning when the prefill fit is off by more on a run


def _best(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return min(out)


DECODE_STEPS = 4  # decode steps timed after each context: positions up to max_len + DECODE_STEPS


def check_max_len(lm: LoadedModel, max_len: int) -> None:
    """A ValueError unless the model has positions for everything `measure` runs (`max_len` of
    context, then DECODE_STEPS decode steps): past them a model fails deep in torch (an
    IndexError on GPT-2's position table) after minutes of measuring."""
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and max_len + DECODE_STEPS > limit:
        raise ValueError(f"--max-len {max_len}: the model {lm.name} has {limit} positions (max_position_embeddings) "
                         f"and calibrate decodes {DECODE_STEPS} tokens past --max-len: give --max-len "
                         f"{limit - DECODE_STEPS} or less")


@contextmanager
def disk_test_files(big: torch.Tensor, small: torch.Tensor):
    """(big, small): two KV files written into a new temporary folder (removed on exit), for
    timing disk reads. An OSError naming the folder when they cannot be written (a full disk, an
    unwritable $TMPDIR); `measure` writes them before timing anything, so that fails at once."""
    try:
        folder = tempfile.TemporaryDirectory(prefix="pbkv-calibrate-")
    except OSError as e:
        raise OSError(f"calibrate: cannot make a temporary folder for its disk-read test files (set by $TMPDIR): "
                      f"{e}") from None
    with folder as d:
        paths = Path(d) / "big.safetensors", Path(d) / "small.safetensors"
        try:
            for path, kv in zip(paths, (big, small)):
                save_file({"kv": kv.cpu()}, str(path))
        except (OSError, SafetensorError) as e:
            raise OSError(f"calibrate: cannot write its disk-read test files ({big.numel() * big.element_size():,} "
                          f"bytes) in the temporary folder {d} (set by $TMPDIR): {e}") from None
        yield paths


def measure(lm: LoadedModel, max_len: int = 512, repeats: int = 2, seed: int = 0) -> dict:
    """Raw timings on this machine (seconds, bytes); see the module docstring. What can fail
    before the timings end (too few positions for `max_len`, a temporary folder that cannot take
    the disk test files) is checked first."""
    check_max_len(lm, max_len)
    kv_big = lm.empty_kv(max_len).normal_()
    kv_small = lm.empty_kv(1).normal_()
    with disk_test_files(kv_big, kv_small) as (big, small):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(lm.vocab_size // 8, lm.vocab_size, (max_len + 8,), generator=g).tolist()
        forward(lm, ids[:16], make_cache(None))  # warm-up
        prefill = []
        for cached in (0, max_len // 2):
            past = forward(lm, ids[:cached], make_cache(None))[2] if cached else None
            kv = cache_to_kv(past) if past is not None else None
            for new in sorted({max(8, max_len // 8), max_len // 4, max_len // 2}):
                sec = _best(lambda: forward(lm, ids[cached:cached + new], make_cache(kv)), repeats)
                prefill.append({"new": new, "cached": cached, "seconds": sec})
        decode = []
        for ctx in (16, max_len):
            _, _, cache = forward(lm, ids[:ctx], make_cache(None))
            kv = cache_to_kv(cache)
            steps = DECODE_STEPS
            sec = _best(lambda: [forward(lm, [ids[ctx + i]], make_cache(kv)) for i in range(steps)], repeats) / steps
            decode.append({"context": ctx, "seconds": sec})
        nbytes = kv_big.numel() * kv_big.element_size()
        host_big = _best(lambda: kv_big.to("cpu", copy=True), repeats + 2)
        host_small = _best(lambda: kv_small.to("cpu", copy=True), repeats + 2)

        def read(p: Path):
            tensor_sha256(st_load(p.read_bytes())["kv"])
        disk_big, disk_small = _best(lambda: read(big), repeats + 1), _best(lambda: read(small), repeats + 1)
    return {"prefill": prefill, "decode": decode, "kv_bytes": nbytes,
            "host": {"big": host_big, "small": host_small}, "disk": {"big": disk_big, "small": disk_small},
            "params": sum(p.numel() for p in lm.model.parameters()), "threads": torch.get_num_threads()}


def fit_prefill(flops, secs) -> tuple[float, float]:
    """(overhead seconds, seconds per FLOP) of prefill times `secs` against their FLOPs: least
    squares `overhead + flops x per_flop`. Where noise makes that fit meaningless (a slope <= 0,
    or an intercept < 0), the line through the origin instead: no fixed cost, the rate the
    measurements give on their own (an intercept kept from the failed fit would lie above every
    measured prefill)."""
    flops, secs = np.asarray(flops, dtype=float), np.asarray(secs, dtype=float)
    (overhead, per_flop), *_ = np.linalg.lstsq(np.stack([np.ones_like(flops), flops], 1), secs, rcond=None)
    if per_flop <= 0 or overhead < 0:
        overhead, per_flop = 0.0, float(flops @ secs / (flops @ flops))
    return float(overhead), max(float(per_flop), 1e-30)


def fit_decode(decode: list[dict], kv_token: int) -> tuple[float, float]:
    """(seconds per request, HBM GB/s) of the simulator's per-request decode step
    (`decode_request_ms`) fitted to one-request decode steps `decode` (context, seconds) at a short
    and a long context: the real engine runs one forward per running request, so a step of a batch
    costs batch x the fixed per-request cost + the KV of all running contexts at the bandwidth; the
    two measurements give both (a step shorter at the longer context: no context term)."""
    short, long = decode[0], decode[-1]
    extra = long["context"] - short["context"]
    per_token = (long["seconds"] - short["seconds"]) / extra if extra > 0 else 0.0
    hbm = 1e4 if per_token <= 0 else min(1e4, kv_token / per_token / 1e9)
    request = short["seconds"] - kv_token * short["context"] / (hbm * 1e9)
    return max(1e-9, request), hbm


def to_profile(lm: LoadedModel, m: dict, name: str, device_tokens: int = 16384) -> dict:
    """A `pbkv.engine.profiles.Profile` JSON object fitted to measurements `m`."""
    cfg = lm.model.config
    heads, params = cfg.num_attention_heads, m["params"]
    attn = 4 * lm.layers * heads * lm.head_dim
    flops = np.array([2 * params * p["new"] + attn * p["new"] * (p["cached"] + p["new"] / 2) for p in m["prefill"]])
    secs = np.array([p["seconds"] for p in m["prefill"]])
    overhead, per_flop = fit_prefill(flops, secs)
    rate = 1.0 / per_flop
    misfit = float(np.max(np.abs((overhead + flops * per_flop) / secs - 1)))
    short, long = m["decode"][0], m["decode"][-1]
    dtype_bytes = torch.finfo(lm.dtype).bits // 8
    kv_token = lm.kv_bytes_per_token
    weights = params * dtype_bytes
    # the real engine decodes running requests one after another, one forward each: the simulator's
    # step is batch x the fixed per-request cost + the running contexts' KV at `hbm` (decode_request_ms)
    request, hbm = fit_decode(m["decode"], kv_token)
    memory_gib = (weights + device_tokens * kv_token) / GIB
    host_gbps = m["kv_bytes"] / max(1e-9, m["host"]["big"] - m["host"]["small"]) / 1e9
    disk_gbps = m["kv_bytes"] / max(1e-9, m["disk"]["big"] - m["disk"]["small"]) / 1e9
    decode_mfu = min(1.0, 2 * params / request / rate)
    return {
        "name": name,
        "description": f"Measured by `pbkv calibrate` on this machine: {lm.name} ({params / 1e6:.1f} M params, "
                       f"{lm.dtype}) on {lm.device}, {m['threads']} torch threads.",
        "sources": [
            f"prefill: {len(secs)} runs fitted as {overhead * 1e3:.2f} ms + FLOPs / {rate / 1e9:.2f} GFLOP/s "
            f"(worst run off by {100 * misfit:.0f}%)",
            f"decode step, one request: {short['seconds'] * 1e3:.2f} ms at {short['context']} tokens of context, "
            f"{long['seconds'] * 1e3:.2f} ms at {long['context']}; fitted as batch x {request * 1e3:.3f} ms + "
            f"context KV at {hbm:.3g} GB/s",
            f"host copy: {host_gbps:.2f} GB/s, {m['host']['small'] * 1e3:.3f} ms latency; disk read + sha256: "
            f"{disk_gbps:.2f} GB/s, {m['disk']['small'] * 1e3:.3f} ms latency",
            *([f"warning: the prefill timings are noise-dominated (the fit is off by {100 * misfit:.0f}% on one "
               f"run{'; a longer prefill measured faster, so no fixed cost was fitted' if overhead == 0 else ''}): "
               f"measure on a quiet machine, with more --repeats or a longer --max-len"]
              if misfit > MISFIT_WARN else []),
            "raw: " + json.dumps(m),
        ],
        "model": {"name": lm.name, "params_b": params / 1e9, "layers": lm.layers, "heads": heads,
                  "kv_heads": lm.kv_heads, "head_dim": lm.head_dim, "dtype_bytes": dtype_bytes},
        "gpu": {"name": f"{lm.device.type} (measured)", "count": 1, "memory_gib": memory_gib,
                "tflops": rate / 1e12, "hbm_gbps": hbm, "pcie_gbps": host_gbps},
        "mem_fraction": 1.0, "reserve_gib": 0.0,
        "prefill_mfu": 1.0, "decode_mfu": max(1e-6, decode_mfu), "decode_bw_eff": 1.0, "pcie_eff": 1.0,
        "load_latency_ms": m["host"]["small"] * 1e3, "disk_gbps": disk_gbps,
        "disk_latency_ms": max(0.0, m["disk"]["small"] - m["host"]["small"]) * 1e3,
        "step_overhead_ms": overhead * 1e3, "decode_request_ms": request * 1e3, "max_prefill_tokens": 1, "max_running": 64,
        "host_ratio": 2.0, "disk_tokens": 0,
    }
