"""KV tensors in safetensors files: the checksum and the parser both disk tiers share.

Light on purpose (torch and safetensors only, no transformers): the shared tier
(`pbkv.engine.shared_kv`) runs in processes that never load a model. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load


class CorruptKV(RuntimeError):
    """A disk entry cannot be read back exactly (missing, truncated, corrupt or wrong file)."""


def worth_logging(failures: int) -> bool:
    """Whether a tier logs its `failures`-th failed write: the first, then every 1,000th (a full
    or read-only folder gives a few lines, not one per block)."""
    return failures == 1 or failures % 1000 == 0


def tensor_sha256(t: torch.Tensor) -> str:
    """The sha256 of `t`'s bytes, for a tensor of any shape: flattened first, since a 0-dim
    tensor (a file read back may hold anything) cannot be viewed as bytes."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def load_kv(path: Path) -> tuple[dict, torch.Tensor]:
    """(metadata, tensor "kv") of a safetensors KV file, unverified; `CorruptKV` if it is missing
    or cannot be parsed. Callers check the checksum against what they expect."""
    try:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + n]).get("__metadata__") or {}
        data = st_load(raw)["kv"]
    except FileNotFoundError:
        raise CorruptKV(f"{path.name}: file missing") from None
    except (OSError, ValueError, KeyError, AttributeError, SafetensorError, UnicodeDecodeError) as e:
        raise CorruptKV(f"{path.name}: unreadable ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})") from None
    return meta, data
