"""pbkv's RequestRouter inside a real local Ray Serve, over 2 model-free `Probe` replicas.

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
from pbkv.scale.probe import overhead, probe_app, workflow_hints  # noqa: E402

pytestmark = pytest.mark.ray
SRC = str(Path(__file__).resolve().parent.parent / "src")


@pytest.fixture(scope="module")
def ray_local():
    # replicas run in Ray worker processes: they must import this checkout's pbkv
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # handles only, no HTTP: without a proxy actor there is nothing for Serve's controller to
    # kill when it starts slowly (CI, a loaded 2-core machine: `ActorDiedError` in serve.run)
    serve.start(proxy_location="Disabled")
    yield started
    serve.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("router", ["sticky", "pbkv"])
def test_workflows_stay_on_one_replica_and_spread_over_both(ray_local, router):
    handle = serve.run(probe_app(2, router), name=f"p-{router}", route_prefix=None)
    placed: dict[str, set[str]] = {}
    for hints in workflow_hints(workflows=4, steps=4):
        answer = handle.remote(hints).result(timeout_s=60)
        assert answer["hints"] == hints
        placed.setdefault(hints["workflow_id"], set()).add(answer["replica"])
    assert all(len(r) == 1 for r in placed.values()), placed
    assert len(set().union(*placed.values())) == 2, placed
    serve.delete(f"p-{router}")


def test_round_robin_alternates_and_requests_without_hints_still_route(ray_local):
    handle = serve.run(probe_app(2, "round-robin"), name="p-rr", route_prefix=None)
    got = [handle.remote(h).result(timeout_s=60)["replica"] for h in workflow_hints(workflows=1, steps=6)]
    assert len(set(got)) == 2 and all(a != b for a, b in zip(got, got[1:])), got
    assert {handle.remote("no hints").result(timeout_s=60)["replica"] for _ in range(4)} <= set(got)
    serve.delete("p-rr")


@pytest.mark.parametrize("router", ["sticky", "pbkv"])
def test_64_concurrent_clients_lose_and_mix_up_nothing(ray_local, router):
    handle = serve.run(probe_app(2, router, service_s=0.01), name=f"p64-{router}", route_prefix=None)
    out = overhead(handle, clients=64, steps=3)
    assert (out["requests"], out["mixed_up"], out["workflows"]) == (192, 0, 64), out
    if router == "sticky":   # pbkv may move a workflow off a long queue; sticky never does
        assert out["workflows_on_one_replica"] == 64, out
    serve.delete(f"p64-{router}")


def test_a_killed_replica_is_routed_around_and_its_workflows_placed_again(ray_local):
    handle = serve.run(probe_app(2, "sticky"), name="p-kill", route_prefix=None)
    first = {h["workflow_id"]: handle.remote(h).result(timeout_s=60)["replica"]
             for h in workflow_hints(workflows=4, steps=1)}
    victim = sorted(set(first.values()))[0]
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if victim in a["name"] and "p-kill" in a["name"]]
    assert len(actors) == 1, actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    failures, placed = 0, {}
    for h in workflow_hints(workflows=4, steps=3):
        for _attempt in range(3):          # the client's retry: a call sent to the dead replica fails
            try:
                answer = handle.remote(h).result(timeout_s=60)
                break
            except Exception:  # noqa: BLE001 - Ray raises ActorDiedError / RayActorError subclasses
                failures += 1
        else:
            pytest.fail(f"{h['workflow_id']} failed 3 times")
        assert answer["hints"] == h
        placed.setdefault(h["workflow_id"], []).append(answer["replica"])
    assert failures <= 1                       # at most the one call that found the replica dead
    assert all(victim not in r for r in placed.values()), placed
    moved = {w for w, r in first.items() if r == victim}
    assert all(len(set(placed[w])) == 1 for w in moved), placed   # placed again once, then sticky
    serve.delete("p-kill")
