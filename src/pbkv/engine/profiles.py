"""Hardware + model profiles for the simulator's cost model, with their sources.

A profile is a JSON file (built-ins live in `engine/profiles/`); `load_profile` takes a built-in
name or a path. Every number says where it comes from in the file's `sources`.

Invariant: a profile that loads gives finite costs. Every number is finite (no Infinity or NaN),
and rates, efficiencies, sizes and latencies lie within the bounds below: each rate the cost
model divides by (FLOP/s, bytes/s) is at least RATE_MIN x 1e9 x EFF_MIN > 0 and at most
MAX_GPUS x RATE_MAX x 1e12, so no time, bandwidth or capacity derived from it overflows.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from pbkv import unique_json
from pbkv.files import read_text

GIB = 1024 ** 3

# Bounds far outside any real hardware, close enough that every derived cost stays finite.
RATE_MIN, RATE_MAX = 1e-6, 1e6   # TFLOP/s and GB/s per GPU (calibrate on a CPU: ~1e-3 TFLOP/s)
EFF_MIN = 1e-6                   # utilisations and efficiencies (calibrate writes >= 1e-6)
MAX_GIB = 1e6                    # GPU memory and reserve, GiB per GPU
MAX_MS = 1e6                     # fixed latencies and overheads, ms (about 17 minutes)
MAX_DIM = 1_000_000              # layers, heads, head_dim
MAX_GPUS = 65536                 # GPUs per model instance
# JSON's Infinity, -Infinity and NaN are refused; a misspelt field is an error, not ignored (its
# default would be used without a word); strict: "500" is not a number, true is not 1, 64.0 is
# not an int (an int is still a float)
FINITE = ConfigDict(allow_inf_nan=False, extra="forbid", strict=True)


def _rate(description: str):
    return Field(ge=RATE_MIN, le=RATE_MAX, description=description)


def _eff(default: float, description: str = ""):
    return Field(default, ge=EFF_MIN, le=1, description=description)


def _ms(default: float, description: str = ""):
    return Field(default, ge=0, le=MAX_MS, description=description)


class ModelShape(BaseModel):
    model_config = FINITE
    name: str
    params_b: float = Field(gt=0, le=1e6, description="parameters, billions")
    layers: int = Field(gt=0, le=MAX_DIM)
    heads: int = Field(gt=0, le=MAX_DIM, description="query heads")
    kv_heads: int = Field(gt=0, le=MAX_DIM)
    head_dim: int = Field(gt=0, le=MAX_DIM)
    dtype_bytes: int = Field(2, gt=0, le=8)


class GPUs(BaseModel):
    model_config = FINITE
    name: str
    count: int = Field(gt=0, le=MAX_GPUS, description="GPUs serving one model instance (tensor parallel)")
    memory_gib: float = Field(gt=0, le=MAX_GIB, description="per GPU")
    tflops: float = _rate("dense bf16 tensor TFLOP/s per GPU")
    hbm_gbps: float = _rate("memory bandwidth per GPU, GB/s")
    pcie_gbps: float = _rate("host<->device bandwidth per GPU and direction, GB/s")


class Profile(BaseModel):
    """Everything the cost model needs; efficiencies turn peak numbers into achieved ones.
    Every number is finite and within the module's bounds (see the module docstring)."""

    model_config = FINITE
    name: str
    description: str = ""
    sources: list[str] = []
    model: ModelShape
    gpu: GPUs
    mem_fraction: float = Field(0.9, gt=0, le=1, description="share of GPU memory the server may use")
    reserve_gib: float = Field(2.0, ge=0, le=MAX_GIB, description="per GPU: activations, graphs, fragmentation")
    prefill_mfu: float = _eff(0.5)
    decode_mfu: float = _eff(0.3)
    decode_bw_eff: float = _eff(0.7, "achieved share of HBM bandwidth in decode")
    pcie_eff: float = _eff(0.5, "achieved share of PCIe for paged KV copies")
    load_latency_ms: float = _ms(0.5, "fixed cost of one host->device load")
    disk_gbps: float = Field(2.0, ge=RATE_MIN, le=RATE_MAX, description="disk read bandwidth, GB/s")
    disk_latency_ms: float = _ms(1.0)
    step_overhead_ms: float = _ms(2.0, "per forward pass: scheduling, launches, TP sync")
    decode_request_ms: float | None = Field(
        None, ge=0, le=MAX_MS,
        description="an engine that decodes running requests one after another (one forward each, as the HF "
                    "engine does): the fixed cost of one request's decode forward; its step is then batch x this "
                    "+ the running contexts' KV at hbm_gbps x decode_bw_eff (no compute term, no "
                    "step_overhead_ms). None (the default, every built-in profile): a batched decode step, "
                    "max(compute, memory) + step_overhead_ms")
    max_prefill_tokens: int = Field(16384, gt=0, description="new tokens per prefill batch")
    max_running: int = Field(256, gt=0, description="requests decoding at once")
    host_ratio: float = Field(2.0, ge=0, le=1e6, description="host KV tokens = ratio x device KV tokens")
    disk_tokens: int = Field(0, ge=0)
    # where it was read from (`profile_from_data`), named in errors: a copied file's `name` is
    # the profile it was copied from
    _where: str | None = PrivateAttr(None)

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, whole instance."""
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.model.params_b * 1e9 * self.model.dtype_bytes

    @property
    def device_tokens(self) -> int:
        """KV capacity: GPU memory x fraction - weights - reserve, over bytes per token."""
        g, m = self.gpu, self.model
        per_gpu = g.memory_gib * GIB * self.mem_fraction - self.weight_bytes / g.count - self.reserve_gib * GIB
        if per_gpu <= 0:
            over, per = (f" over gpu.count {g.count} GPUs", " per GPU") if g.count > 1 else ("", "")
            raise ValueError(f"{self._where or f'profile {self.name}'}: model.params_b {m.params_b:g} x "
                             f"model.dtype_bytes {m.dtype_bytes} ({self.weight_bytes / 1e9:g} GB of weights{over}) "
                             f"and reserve_gib {self.reserve_gib:g} leave no KV memory in gpu.memory_gib "
                             f"{g.memory_gib:g} x mem_fraction {self.mem_fraction:g}{per}")
        return int(per_gpu * g.count // self.kv_bytes_per_token)

    @property
    def host_tokens(self) -> int:
        return int(self.device_tokens * self.host_ratio)


def builtin_profiles() -> list[str]:
    folder = resources.files("pbkv.engine") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile name (see `builtin_profiles`) or a JSON file path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        where = str(path)
        text = read_text(path)
    elif name_or_path in builtin_profiles():
        ref = resources.files("pbkv.engine") / "profiles" / f"{name_or_path}.json"
        text, where = ref.read_text(), f"profile {name_or_path}"
    else:
        what = "no such file" if path.suffix == ".json" else "not a built-in name nor a .json file"
        raise ValueError(f"unknown profile {name_or_path!r} ({what}); built-in profiles: "
                         f"{', '.join(builtin_profiles())}")
    try:
        data = unique_json.loads(text)
    except unique_json.DuplicateKey as e:
        raise ValueError(f"{where}: not valid JSON: duplicate key {e.key!r} (which one counts is left to chance)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    return profile_from_data(data, where)


def profile_from_data(data, where: str) -> Profile:
    """`data` (parsed JSON) as a Profile; a ValueError names `where`, the field and the value
    otherwise. Every field must be declared and of its type (no coercion)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{where}: {_first_error(e)}") from None
    profile._where = where
    return profile


def _first_error(e: ValidationError) -> str:
    """`field 'a.b': message, got value` for the first error (`unknown field` for an undeclared one)."""
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"field '{loc}': unknown field"
    return f"field '{loc}': {first['msg']}, got {first.get('input')!r}"
