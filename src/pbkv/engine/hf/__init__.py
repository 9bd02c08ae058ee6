"""The real engine: a transformers causal LM over the shared radix cache, with KV tensors in three
real tiers (device, host RAM, safetensors files on disk). Needs `transformers` (a pbkv
dependency); the `smollm2` model needs the `pbkv[smollm2]` extra."""

from pbkv.engine.hf.engine import EngineError, EngineOptions, EngineStats, HFEngine, Output, Stuck
from pbkv.engine.hf.kvstore import CorruptKV, KVStore
from pbkv.engine.hf.model import LoadedModel, ModelLoadError, load_model
from pbkv.engine.hf.sampling import sample
from pbkv.engine.hf.tokens import TokenMapper, block_hashes, scale_trace
from pbkv.engine.hf.transfer import ManualClock, WallClock, Worker
from pbkv.engine.sampling import CANCELLED, ERROR, LENGTH, STOP, Sampling  # re-exported: HFEngine's API

__all__ = ["HFEngine", "EngineOptions", "EngineStats", "EngineError", "Stuck", "Output", "Sampling", "sample",
           "LENGTH", "STOP", "CANCELLED", "ERROR", "KVStore", "CorruptKV",
           "LoadedModel", "ModelLoadError", "load_model", "TokenMapper", "block_hashes", "scale_trace",
           "ManualClock", "WallClock", "Worker"]
