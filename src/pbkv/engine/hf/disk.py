"""Disk-tier KV files: one safetensors file per evicted node, checked on every read.

A file holds one tensor "kv" ([layers, 2, kv_heads, tokens, head_dim]) and metadata with the
format name and the sha256 of the tensor's bytes; the store also keeps the checksum in memory.
`read_file` returns the tensor only when the file parses, its format is ours, its data hashes to
both checksums and its length is right; anything else (missing, truncated, flipped bytes, a
valid file with other data) raises `CorruptKV`. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file

FORMAT = "pbkv-kv"


class CorruptKV(RuntimeError):
    """A disk entry cannot be read back exactly (missing, truncated, corrupt or wrong file)."""


@dataclass(eq=False)
class DiskFile:
    path: Path
    tokens: int
    refs: int = 1
    data: torch.Tensor | None = None   # the host tensor until the write finished
    sha256: str | None = None          # set by the write
    error: str | None = None           # the write failed: the entry is lost


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def write_file(f: DiskFile) -> int:
    """Write `f.data` to `f.path`, setting `f.sha256`; returns the bytes of KV written."""
    data = f.data.contiguous()
    f.sha256 = tensor_sha256(data)
    save_file({"kv": data}, str(f.path), metadata={"format": FORMAT, "sha256": f.sha256, "tokens": str(f.tokens),
                                                   "dtype": str(data.dtype), "shape": json.dumps(list(data.shape))})
    return data.numel() * data.element_size()


def read_file(f: DiskFile) -> torch.Tensor:
    """The tensor of `f`, verified (see the module docstring)."""
    where = f.path.name
    if f.error is not None:
        raise CorruptKV(f"{where}: write failed ({f.error})")
    try:
        raw = f.path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + n]).get("__metadata__") or {}
        data = st_load(raw)["kv"]
    except FileNotFoundError:
        raise CorruptKV(f"{where}: file missing") from None
    except (OSError, ValueError, KeyError, AttributeError, SafetensorError, UnicodeDecodeError) as e:
        raise CorruptKV(f"{where}: unreadable ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})") from None
    digest = tensor_sha256(data)
    if meta.get("format") != FORMAT or digest != meta.get("sha256") or digest != f.sha256 \
            or data.dim() != 5 or data.shape[3] != f.tokens:
        raise CorruptKV(f"{where}: checksum mismatch")
    return data
