"""pbkv's router in front of Ray Serve LLM's vLLM replicas (CPU, SmolLM2-135M), the pbkv connector in each.

Marked `vllm` and `ray`: it needs vLLM, Ray Serve and what `ray.serve.llm` imports in one venv
(`.venv-vllm-ray`, layered over `.venv-vllm`: see docs/scale-out.md and .ci/run) and the converted
SmolLM2 (`.ci/run` step 2). The module starts one local Ray and one app of 2 vLLM CPU replicas
(eager mode: no torch.compile) and shares them between its tests. Skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.ray]
pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/run)")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve.llm", reason="Ray Serve LLM's imports (pyarrow, jsonref) are missing")
from ray import serve  # noqa: E402

from pbkv.scale.llm import PBKVLLMServer, build_app  # noqa: E402

SRC = str(Path(__file__).resolve().parent.parent / "src")
MODEL = Path(os.environ.get("PBKV_CACHE", Path.home() / ".cache" / "pbkv")) / "smollm2-135m-instruct"
ENGINE = {"dtype": "float32", "block_size": 32, "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True}
COSTS = {"prefill_s_per_token": 1e-3, "queue_s_per_request": 0.01}
WORKFLOWS, STEPS = 4, 3


def app_for(tmp: Path, router: str = "pbkv"):
    return build_app("smollm2", str(MODEL), replicas=2, router=router, router_config=COSTS, cpu=True,
                     connector={"policy": "lru", "host_tokens": 4096, "stats_path": str(tmp / "stats.json")},
                     engine_kwargs=ENGINE, stats_period_s=0.5,
                     runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": SRC}})


@pytest.fixture(scope="module")
def ray_local():
    # replicas run in Ray worker processes: they must import this checkout's pbkv
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             namespace="pbkv-ray-llm-test")
    yield
    serve.shutdown()
    ray.shutdown()


def test_the_app_wires_router_server_and_connector(ray_local, tmp_path):
    """Built, not started: what Ray Serve will be given (building reads Ray's runtime context)."""
    ingress = app_for(tmp_path)._bound_deployment
    llm = ingress.init_kwargs["llm_deployments"]["smollm2"]._bound_deployment
    assert ingress.num_replicas == 1 and llm.num_replicas == 2
    assert issubclass(llm.func_or_class, PBKVLLMServer)
    rrc = llm._deployment_config.request_router_config
    assert rrc.request_router_class == "pbkv.scale.ray_router:PBKVRequestRouter"
    assert rrc.request_router_kwargs == {"router": "pbkv", "config": COSTS, "chunk_chars": 64, "chars_per_token": 4}
    cfg = llm.init_kwargs["llm_config"]
    kvt = cfg.engine_kwargs["kv_transfer_config"]
    assert (kvt["kv_connector"], kvt["kv_connector_module_path"]) == ("PBKVConnector", "pbkv.integrations.vllm.connector")
    assert cfg.engine_kwargs["enable_prefix_caching"] is True


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    if not (MODEL / "config.json").exists():
        pytest.skip(f"SmolLM2 not converted at {MODEL} (.ci/run step 2 converts it)")
    tmp = tmp_path_factory.mktemp("ray-llm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_for(tmp), name="llm", route_prefix="/")
    print(f"2 vLLM replicas up in {time.perf_counter() - t0:.0f} s")
    yield port, tmp
    serve.delete("llm")


def chat(port: int, messages: list, workflow: str, agent: str) -> str:
    body = {"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0,
            "kv_transfer_params": {"workflow_id": workflow}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Agent": agent})
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    assert answer["model"] == "smollm2" and answer["object"] == "chat.completion", answer
    return answer["choices"][0]["message"]["content"]


def run_workflow(port: int, name: str, task: int) -> list[tuple[list, str]]:
    """STEPS calls that each extend the chat; returns (messages, answer) per call."""
    messages = [{"role": "system", "content": f"You are assistant number {task}. Answer briefly. " * 4},
                {"role": "user", "content": f"Task {task}: list three things about the number {task}."}]
    out = []
    for step in range(STEPS):
        answer = chat(port, messages, name, "planner" if step == 0 else "worker")
        out.append((list(messages), answer))
        messages = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    return out


def workflows_per_replica() -> dict[str, set[str]]:
    """Each replica's reported workflows (what its `record_routing_stats` says it served)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if "PBKVLLMServer" in a["name"]:
            stats = ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).record_routing_stats.remote())
            out[a["name"]] = set(stats["workflows"])
    return out


def test_a_workflows_calls_stay_on_one_replica_and_answers_are_right(served):
    port, tmp = served
    t0 = time.perf_counter()
    with ThreadPoolExecutor(WORKFLOWS) as pool:     # 4 workflows at once, each call after the previous
        first = dict(zip(range(WORKFLOWS), pool.map(lambda t: run_workflow(port, f"w{t}", t), range(WORKFLOWS))))
    t1 = time.perf_counter()
    # the same chats again as new workflows: greedy answers must be equal (another replica or
    # cached KV must not change them), and each follows its twin's prefix to its replica
    def replay(t):
        return [chat(port, messages, f"again-{t}", "planner") for messages, _ in first[t]]
    with ThreadPoolExecutor(WORKFLOWS) as pool:
        again = dict(zip(range(WORKFLOWS), pool.map(replay, range(WORKFLOWS))))
    assert again == {t: [a for _, a in calls] for t, calls in first.items()}
    t2 = time.perf_counter()
    placed = workflows_per_replica()
    assert len(placed) == 2, placed
    where = {wf: [r for r, wfs in placed.items() if wf in wfs] for wf in set().union(*placed.values())}
    print(f"placement {placed}; {WORKFLOWS * STEPS} calls in {t1 - t0:.1f} s, replay {t2 - t1:.1f} s")
    for path in sorted(tmp.glob("stats-replica-*.json")):
        print(path.name, path.read_text())
    assert all(len(r) == 1 for r in where.values()), where                      # one replica per workflow
    assert {f"w{t}" for t in range(WORKFLOWS)} | {f"again-{t}" for t in range(WORKFLOWS)} == set(where)
    assert len({where[f"w{t}"][0] for t in range(WORKFLOWS)}) == 2, where       # spread over both
    assert all(where[f"again-{t}"] == where[f"w{t}"] for t in range(WORKFLOWS)), where   # prefix followed
    assert all(a.strip() for calls in first.values() for _, a in calls)
