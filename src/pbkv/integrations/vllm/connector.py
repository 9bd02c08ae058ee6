"""`PBKVConnector`: vLLM's KV-connector interface (v1) over pbkv's tiers and policy.

Load it with no fork of vLLM:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PBKVConnector",
        "kv_connector_module_path": "pbkv.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"policy": "pbkv", "predictor_dir": "predictor/"}}'

Extra config (all optional): `policy` (a pbkv policy name, default "lru" without `predictor_dir`,
"pbkv" with one), `predictor_dir` (a predictor saved by `pbkv train`), `device_tokens` (pbkv's model
of vLLM's GPU prefix cache; default vLLM's whole pool), `host_tokens` (RAM tier, default 4 x
device), `disk_tokens` (default 0: no disk tier), `disk_dir`, `steer_gpu` (default true: see
`gpu_pool.py`), `stats_path` (a JSON file rewritten as requests finish), `shared_dir` (a directory
of KV blocks shared by every instance of the same model, keyed by vLLM's block hashes: needs a
sha256 `prefix_caching_hash_algo` and, on a vLLM older than 0.32, the same PYTHONHASHSEED on
every instance, else the connector refuses to start; see `shared.py`) and `shared_bytes` (its bound, default 8 GiB).
The extra config is checked before anything is built (`config.py`: types, ranges, unknown keys).

vLLM builds one instance per role: the scheduler's (`shadow.Shadow`: tree, policy, decisions)
and one per worker rank (`store.BlockStore`: the data). Decisions travel as the step's metadata
(`PBKVMeta`), so every rank executes the same plan. Loads are synchronous (done in
`start_load_kv`, before the forward), saves happen in `wait_for_save` (after it); both copy
whole blocks between the paged cache and the store. A block that fails to load is reported
through `get_block_ids_with_load_errors`; with `kv_load_failure_policy` "recompute" (set by
`pbkv.integrations.vllm.kv_transfer_config`) vLLM recomputes it, with "fail" (vLLM's default)
it fails the request (the connector warns at start). Either way no wrong KV is kept: the worker
saves nothing computed from a failed block in that step, and `update_connector_output` tells
the shadow, which plans those saves again when the blocks are next computed (`shadow.py`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from pbkv.integrations.vllm import require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402

from pbkv.cache import CacheConfig, CapacityDefaults  # noqa: E402
from pbkv.integrations.vllm.config import ConnectorConfig, connector_policy, parse_extra  # noqa: E402
from pbkv.integrations.vllm.hints import parse_hints  # noqa: E402
from pbkv.integrations.vllm.shared import SharedBlocks, instance_identity, key_problem  # noqa: E402
from pbkv.integrations.vllm.shadow import Plan, Shadow  # noqa: E402
from pbkv.integrations.vllm.store import BlockStore, StoreStats  # noqa: E402
from pbkv.policy.registry import needed_predictor  # noqa: E402
from pbkv.predict.base import require_variant  # noqa: E402

log = logging.getLogger("pbkv.vllm")


@dataclass
class PBKVMeta(KVConnectorMetadata):
    plan: Plan


FAILURE_COUNTERS = ("write_failed", "load_failed", "corrupt", "missing", "shared_failed")   # of store.StoreStats


@dataclass
class WorkerStats(KVConnectorStats):
    """The worker stores' counters (`store.StoreStats`) gained since the last report, summed over
    ranks: vLLM carries them from the workers to the scheduler, whose connector keeps the running
    totals for the `stats_path` JSON ("worker"). `data` maps a counter's name to an int."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "WorkerStats":
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def block_key(block_hash) -> int:
    """A vLLM block hash (bytes, chained over the prefix) as a 63-bit int tree key."""
    raw = bytes(block_hash)
    return int.from_bytes(raw[:8], "little") >> 1


class PBKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = parse_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.shadow: Shadow | None = None
        self.store: BlockStore | None = None
        self._pool = None
        self._local: dict[str, int] = {}   # request -> vLLM's own prefix hit at the last lookup
        self._worker_totals = {f.name: 0 for f in fields(StoreStats)}   # scheduler: the workers' counters
        self._reported = dict(self._worker_totals)                       # worker: counters already sent
        rank = getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0
        if role == KVConnectorRole.SCHEDULER:
            self.shadow = self._make_shadow(self.config)
            self.shadow.shared = self._shared(vllm_config, self.config, None)
            self._stats_failed = False
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") == "fail":
                log.warning("pbkv connector: kv_load_failure_policy is 'fail', so a block the connector cannot "
                            "load (a corrupt or lost file) fails its request instead of being recomputed; set "
                            "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config "
                            "(pbkv.integrations.vllm.kv_transfer_config does)")
        else:
            self.store = BlockStore(self.config.disk_dir, rank=rank,
                                    shared=self._shared(vllm_config, self.config, rank))

    @staticmethod
    def _shared(vllm_config, config: ConnectorConfig, rank: int | None) -> SharedBlocks | None:
        """The shared directory for one rank (a worker) or every rank (the scheduler: None)."""
        if config.shared_dir is None:
            return None
        cache, model = vllm_config.cache_config, vllm_config.model_config
        algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
        from vllm.v1.core import kv_cache_utils
        problem = key_problem(algo, os.environ, hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED"))
        if problem is not None:
            raise ValueError(f"pbkv connector: shared_dir {config.shared_dir!r} refused: {problem}")
        world = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1
        from pbkv.engine.hf.shared import config_fingerprint
        hf_config = getattr(model, "hf_config", None)
        fingerprint = config_fingerprint(hf_config) if hf_config is not None else "-"
        ids = [instance_identity(model.model, getattr(model, "revision", None), model.dtype, cache.cache_dtype,
                                 cache.block_size, algo, r, world, fingerprint)
               for r in ([rank] if rank is not None else range(world))]
        return SharedBlocks(config.shared_dir, ids, config.shared_bytes)

    def _make_shadow(self, config: ConnectorConfig) -> Shadow:
        predictor_dir = config.predictor_dir
        policy = connector_policy(config)   # its errors name the extra config's keys, not bench's flags
        predictors = {}
        variant = needed_predictor(policy)
        if predictor_dir:
            from pbkv.predict.predictor import load_predictor  # not bench's: it pins torch to 1 thread
            predictors = {variant: load_predictor(predictor_dir)}
            require_variant(predictors[variant], variant, policy, f"pbkv connector: predictor_dir {predictor_dir!r}")
        asked = CacheConfig(config.device_tokens, config.host_tokens, config.disk_tokens)
        caps = asked.resolve(CapacityDefaults(max(self.num_blocks - 1, 1) * self.block_size, host_ratio=4))
        shadow = Shadow(self.block_size, caps, policy, predictors, agent_graph=config.agent_graph,
                        static_sequence=config.static_sequence)
        log.info("pbkv connector: policy %s, tiers %s", policy, caps)
        return shadow

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self.shadow is None or not self.config.steer_gpu:
            return
        from pbkv.integrations.vllm.gpu_pool import GPUSteer
        self._pool = GPUSteer(gpu_block_pool, self.shadow.stats)
        self.shadow.ops.on_device_evict = self._pool.demote

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        keys = [block_key(h) for h in request.block_hashes]
        if self._pool is not None:
            self._pool.remember(keys, request.block_hashes)
        hints = parse_hints(request.kv_transfer_params)
        self._local[request.request_id] = num_computed_tokens
        n = self.shadow.match(request.request_id, keys, request.num_prompt_tokens, num_computed_tokens, hints,
                              hashes=list(request.block_hashes) if self.shadow.shared is not None else None)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if request.request_id in self.shadow.reqs:
            self.shadow.allocated(request.request_id, self._local.pop(request.request_id, 0), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        scheduled = []
        n_sched = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            scheduled.append((r.req_id, r.block_ids[0], True, r.num_computed_tokens + n_sched.get(r.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            scheduled.append((req_id, new[0] if new is not None else None, req_id in cached.resumed_req_ids,
                              cached.num_computed_tokens[i] + n_sched.get(req_id, 0)))
        return PBKVMeta(self.shadow.build(scheduled))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._local.pop(request.request_id, None)
        self.shadow.finished(request.request_id)
        if self.config.stats_path is not None:
            self._write_stats(self.config.stats_path)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed:
            self.shadow.load_failed(set(failed))
        gained = getattr(connector_output, "kv_connector_stats", None)
        gained = gained.data if isinstance(gained, KVConnectorStats) else gained
        if isinstance(gained, dict) and any(gained.values()):
            for name, value in gained.items():
                if name in self._worker_totals and isinstance(value, int):
                    self._worker_totals[name] += value
            # written now when a failure came, or no request is left (the last step's saves come
            # after its request ended); else at the next request's end: a file rewrite per step
            # would sit on the scheduler's hot path
            urgent = any(gained.get(k) for k in FAILURE_COUNTERS) or not self.shadow.reqs
            if self.config.stats_path is not None and urgent:
                self._write_stats(self.config.stats_path)

    def get_kv_connector_stats(self) -> WorkerStats | None:
        """(worker) The store's counters gained since the last call; None when nothing changed
        (the scheduler's instance has no store: None)."""
        if self.store is None:
            return None
        now = asdict(self.store.stats)
        gained = {name: now[name] - self._reported[name] for name in self._reported}
        self._reported = now
        return WorkerStats(data=gained) if any(gained.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> WorkerStats:
        return WorkerStats(data=dict(data or {}))

    def _write_stats(self, path: str) -> None:
        """Replace the stats file atomically (a reader never sees half of one); an error is
        logged once and never reaches vLLM (it would fail the request and hang the engine)."""
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.stats(), f)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not self._stats_failed:
                log.warning("pbkv connector: cannot write stats_path %r (%s); stats are not written", path, e)
            self._stats_failed = True

    def stats(self) -> dict:
        s = self.shadow.stats
        return {**asdict(s), "computed_tokens": s.computed_tokens, "policy": self.shadow.policy.name,
                "worker": dict(self._worker_totals)}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches) -> None:
        self.store.register(kv_caches, self.num_blocks)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PBKVMeta)
        self.store.before_forward(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return   # whole blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        self.store.after_forward(self._get_connector_metadata().plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.store is None:
            return set()
        failed, self.store.failed = self.store.failed, set()
        return failed

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
