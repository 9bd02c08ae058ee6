"""A model-free Ray Serve replica for checking and timing routing (needs `pbkv[scale]`).

`Probe` replicas keep every prompt they are sent as "cached" and report it in
`record_routing_stats` exactly as an engine replica would (`ReplicaSnapshot.to_stats()` plus a
`seq` that changes with every report), then answer with their replica id after `service_s`
seconds, echoing the request's hints (so a client can tell a mixed-up answer). `overhead`
drives one deployment with many concurrent clients and returns latency percentiles, so a
router's cost per request is the difference against Ray's default router.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.config import RequestRouterConfig

from pbkv.route import ReplicaSnapshot

ROUTER_CLASS = "pbkv.scale.ray_router:PBKVRequestRouter"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class Probe:
    def __init__(self, service_s: float = 0.0):
        self.id = serve.get_replica_context().replica_id.unique_id
        self.service_s = service_s
        self.blocks, self.workflows, self.seq, self.running = set(), {}, 0, 0

    def record_routing_stats(self) -> dict:
        self.seq += 1
        snap = ReplicaSnapshot(self.id, self.running, frozenset(self.blocks), dict(self.workflows))
        return snap.to_stats() | {"seq": self.seq}

    async def __call__(self, hints) -> dict:
        self.running += 1
        try:
            if isinstance(hints, dict):
                self.blocks.update(hints["hash_ids"])
                self.workflows[hints["workflow_id"]] = hints["input_tokens"]
            if self.service_s:
                await asyncio.sleep(self.service_s)
            return {"replica": self.id, "hints": hints}
        finally:
            self.running -= 1


# a replica that prefills ~1 ms a token (a small model on a CPU) and queues ~10 ms a request
CPU_COSTS = {"prefill_s_per_token": 1e-3, "queue_s_per_request": 0.01}


def probe_app(replicas: int, router: str | None, service_s: float = 0.0, stats_period_s: float = 0.5,
              config: dict | None = None):
    """A `Probe` application; `router` None keeps Ray's default (power of two choices);
    `config`: `RouterConfig` fields (default `CPU_COSTS`)."""
    opts = {"num_replicas": replicas}
    if router is not None:
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"router": router, "config": CPU_COSTS if config is None else config},
            request_routing_stats_period_s=stats_period_s)
    return Probe.options(**opts).bind(service_s)


def workflow_hints(workflows: int, steps: int):
    """Each workflow's prompt grows by one block a step (a chained prefix); workflows interleave."""
    for step in range(steps):
        for w in range(workflows):
            ids = [1000 * (w + 1) + i for i in range(step + 2)]
            yield {"workflow_id": f"w{w}", "agent": "a", "hash_ids": ids, "input_tokens": 16 * len(ids)}


async def _client(handle, hints: list[dict], latencies: list[float], placed: dict, wrong: list) -> None:
    for h in hints:
        start = time.perf_counter()
        answer = await handle.remote(h)
        latencies.append(time.perf_counter() - start)
        if answer["hints"] != h:
            wrong.append((h, answer))
        placed.setdefault(h["workflow_id"], set()).add(answer["replica"])


def overhead(handle, clients: int = 64, steps: int = 8) -> dict:
    """`clients` concurrent clients, one workflow each, `steps` calls each; latency percentiles
    (seconds), answers that did not match their request, and how many workflows stayed on one
    replica."""
    per_client: dict[str, list[dict]] = {}
    for h in workflow_hints(clients, steps):
        per_client.setdefault(h["workflow_id"], []).append(h)
    latencies: list[float] = []
    placed: dict[str, set] = {}
    wrong: list = []

    async def main():
        await asyncio.gather(*(_client(handle, hs, latencies, placed, wrong) for hs in per_client.values()))
    asyncio.run(main())
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {"requests": len(latencies), "mixed_up": len(wrong), "p50_s": pick(0.5), "p99_s": pick(0.99),
            "workflows_on_one_replica": sum(len(r) == 1 for r in placed.values()), "workflows": len(placed)}
