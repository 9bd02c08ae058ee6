"""pbkv's RequestRouter inside a real local Ray Serve (2 replicas that only record what they get).

Marked `ray`: starting Ray and two replicas takes ~20 s on an idle 2-core machine, ~60 s on a
busy one; the module starts it once. Skipped when Ray is not installed (`pip install pbkv[scale]`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from ray.serve.config import RequestRouterConfig  # noqa: E402

from pbkv.route import ReplicaSnapshot  # noqa: E402

pytestmark = pytest.mark.ray
HERE = Path(__file__).resolve().parent


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class Recorder:
    """A replica without a model: it caches every prompt it is sent and reports that."""

    def __init__(self):
        self.id = serve.get_replica_context().replica_id.unique_id
        self.blocks, self.workflows, self.seq, self.running = set(), {}, 0, 0

    def record_routing_stats(self) -> dict:
        self.seq += 1
        snap = ReplicaSnapshot(self.id, self.running, frozenset(self.blocks), dict(self.workflows))
        return snap.to_stats() | {"seq": self.seq}

    async def __call__(self, hints) -> str:
        if not isinstance(hints, dict):
            return self.id
        self.blocks.update(hints["hash_ids"])
        self.workflows[hints["workflow_id"]] = hints["input_tokens"]
        return self.id


@pytest.fixture(scope="module")
def ray_local():
    started = time.perf_counter()
    src = str(HERE.parent / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, str(HERE), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield started
    serve.shutdown()
    ray.shutdown()


def deploy(router: str, name: str):
    cfg = RequestRouterConfig(request_router_class="pbkv.scale.ray_router:PBKVRequestRouter",
                              request_router_kwargs={"router": router}, request_routing_stats_period_s=0.5)
    return serve.run(Recorder.options(request_router_config=cfg).bind(), name=name, route_prefix=None)


def calls(workflows: int, steps: int):
    """Each workflow's prompt grows by one block a step (a chained prefix), workflows interleaved."""
    for step in range(steps):
        for w in range(workflows):
            ids = [1000 * (w + 1) + i for i in range(step + 2)]
            yield {"workflow_id": f"w{w}", "agent": "a", "hash_ids": ids, "input_tokens": 16 * len(ids)}


@pytest.mark.parametrize("router", ["sticky", "pbkv"])
def test_workflows_stay_on_one_replica_and_spread_over_both(ray_local, router):
    handle = deploy(router, f"rec-{router}")
    placed: dict[str, set[str]] = {}
    for hints in calls(workflows=4, steps=4):
        placed.setdefault(hints["workflow_id"], set()).add(handle.remote(hints).result(timeout_s=60))
    assert all(len(r) == 1 for r in placed.values()), placed
    assert len(set().union(*placed.values())) == 2, placed
    serve.delete(f"rec-{router}")


def test_round_robin_alternates_and_requests_without_hints_still_route(ray_local):
    handle = deploy("round-robin", "rec-rr")
    got = [handle.remote(h).result(timeout_s=60) for h in calls(workflows=1, steps=6)]
    assert len(set(got)) == 2 and all(a != b for a, b in zip(got, got[1:])), got
    assert {handle.remote("no hints").result(timeout_s=60) for _ in range(4)} <= set(got)
    serve.delete("rec-rr")
