"""Disk-tier KV files: one safetensors file per evicted node, checked on every read.

A file holds one tensor "kv" ([layers, 2, kv_heads, tokens, head_dim]) and metadata with the
format name and the sha256 of the tensor's bytes; the store also keeps the checksum in memory.
`read_file` returns the tensor only when the file parses, its format is ours, its data hashes to
both checksums and its length is right; anything else (missing, truncated, flipped bytes, a
valid file with other data) raises `CorruptKV`. No pickle anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pbkv.engine.kvfile import CorruptKV, load_kv, tensor_sha256  # noqa: F401  (re-exported)

FORMAT = "pbkv-kv"


@dataclass(eq=False)
class DiskFile:
    path: Path
    tokens: int
    refs: int = 1
    data: torch.Tensor | None = None   # the host tensor until the write finished
    sha256: str | None = None          # set by the write
    error: str | None = None           # the write failed: the entry is lost


def write_file(f: DiskFile) -> int:
    """Write `f.data` to `f.path`, setting `f.sha256`; returns the bytes of KV written."""
    data = f.data.contiguous()
    f.sha256 = tensor_sha256(data)
    # save_file's mode, 0600: a private tier's KV (users' prompts) is for this process only
    save_file({"kv": data}, str(f.path), metadata={"format": FORMAT, "sha256": f.sha256, "tokens": str(f.tokens),
                                                   "dtype": str(data.dtype), "shape": json.dumps(list(data.shape))})
    return data.numel() * data.element_size()


def read_file(f: DiskFile) -> torch.Tensor:
    """The tensor of `f`, verified (see the module docstring)."""
    where = f.path.name
    if f.error is not None:
        raise CorruptKV(f"{where}: write failed ({f.error})")
    meta, data = load_kv(f.path)
    # format and shape first: they are cheap, and a file with other data need not be hashed
    if meta.get("format") != FORMAT or data.dim() != 5 or data.shape[3] != f.tokens:
        raise CorruptKV(f"{where}: not this entry's KV (shape {list(data.shape)})")
    digest = tensor_sha256(data)
    if digest != meta.get("sha256") or digest != f.sha256:
        raise CorruptKV(f"{where}: checksum mismatch")
    return data
