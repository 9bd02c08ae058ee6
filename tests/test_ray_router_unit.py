"""`PBKVRequestRouter.choose_replicas` on fake replicas and Ray Serve LLM-shaped requests, without
starting Ray (only `ray.serve.request_router` is imported). Marked `ray` so that `.ci/run`'s Ray
step, where Ray is installed, runs it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

pytest.importorskip("ray.serve.request_router")
from pbkv.scale.ray_router import PBKVRequestRouter  # noqa: E402
from test_scale_llm_hints import ChatCompletionRequest, RawRequestInfo  # noqa: E402

pytestmark = pytest.mark.ray


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)

    @property
    def replica_id(self):
        return FakeId(self.name)


@dataclass
class FakePending:
    args: list
    kwargs: dict = field(default_factory=dict)


class NoQueueLens:
    def get(self, _replica_id):
        return None


def router(name: str = "pbkv") -> PBKVRequestRouter:
    r = object.__new__(PBKVRequestRouter)      # Ray's constructor needs a running deployment
    r._replica_queue_len_cache = NoQueueLens()
    r.initialize_state(router=name, config={"prefill_s_per_token": 1e-3, "queue_s_per_request": 0.01})
    return r


def request(workflow: str, turns: int = 1) -> FakePending:
    msgs = [{"role": "system", "content": f"You are assistant {workflow}. " * 6}]
    msgs += [{"role": "user", "content": f"step {i} of {workflow} " * 4} for i in range(turns)]
    return FakePending([ChatCompletionRequest(messages=msgs), RawRequestInfo({"x-workflow-id": workflow})])


def choose(r: PBKVRequestRouter, replicas, pending) -> list[list[str]]:
    ranks = asyncio.run(r.choose_replicas(replicas, pending))
    return [[x.name for x in rank] for rank in ranks]


def test_calls_chosen_together_spread_and_each_workflow_then_stays():
    """Four new workflows chosen before any was sent (a burst) spread over both replicas; each
    workflow's next call goes where its first went."""
    r, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    first = {w: choose(r, replicas, request(w))[0][0] for w in ("w0", "w1", "w2", "w3")}
    assert sorted(first.values()) == ["a", "a", "b", "b"], first
    for w, home in first.items():
        assert choose(r, replicas, request(w, turns=2)) == [[home]]


def test_a_call_without_hints_goes_to_every_candidate():
    r, replicas = router(), [FakeReplica("a"), FakeReplica("b")]
    plain = FakePending([ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), RawRequestInfo()])
    assert choose(r, replicas, plain) == [["a", "b"]]


def test_a_replicas_report_draws_a_workflow_it_served():
    served = request("w9", turns=2).args[0]
    from pbkv.scale.llm_hints import llm_call
    from pbkv.scale.llm_record import ReplicaRecord
    rec = ReplicaRecord("b")
    rec.started(llm_call(served, RawRequestInfo({"x-workflow-id": "w9"})))
    replicas = [FakeReplica("a"), FakeReplica("b", rec.stats())]
    assert choose(router(), replicas, request("w9", turns=3)) == [["b"]]


def test_with_measured_costs_the_router_weighs_what_the_replicas_report():
    measured = router()
    measured.initialize_state(config={"prefill_s_per_token": 1e-3, "queue_s_per_request": 0.01}, measured_costs=True)
    fixed = router()
    replicas = [FakeReplica("r0", {"costs": {"prefill_s_per_token": 2e-5}}),
                FakeReplica("r1", {"costs": {"prefill_s_per_token": 4e-5, "transfer_s_per_token": 1e-6}})]
    for r in (measured, fixed):
        choose(r, replicas, request("w"))
    assert measured.pbkv_router.config.prefill_s_per_token == pytest.approx(3e-5)
    assert measured.pbkv_router.config.transfer_s_per_token == 1e-6
    assert measured.pbkv_router.config.queue_s_per_request == 0.01    # not measured: as configured
    assert fixed.pbkv_router.config.prefill_s_per_token == 1e-3       # off by default
    choose(measured, [FakeReplica("r0"), FakeReplica("r1")], request("w2"))
    assert measured.pbkv_router.config.prefill_s_per_token == 1e-3    # no report: the configured cost again


class StreamHandle:
    """Enough of a deployment handle for `RemoteWorker.route`."""
    app_name = "unit-app"

    def options(self, **_):
        return self


def test_the_sticky_router_never_keeps_a_one_call_workflow_and_forgets_one_that_ended():
    """The ingress's hints reach the router: a call without a workflow id is a workflow of one
    call, ended with it; a `workflow_done` call ends its workflow; so `sticky`'s map stays empty
    (before, it grew by one entry per call, forever)."""
    from pbkv.engine.sampling import Sampling
    from pbkv.scale.remote import RemoteWorker
    from pbkv.serve.jobs import Job
    from pbkv.serve.workflows import Hints

    r, replicas = router("sticky"), [FakeReplica("a"), FakeReplica("b")]
    worker = RemoteWorker(StreamHandle(), 16, None, None)

    def call(hints: Hints) -> str:
        job = Job(list(range(40)), Sampling(max_new_tokens=4), hints)
        pending = FakePending([worker.route(job), job])
        chosen = choose(r, replicas, pending)[0][0]
        r.on_request_routed(pending, FakeId(chosen), None)
        return chosen

    for _ in range(50):
        call(Hints())
    assert len(r.pbkv_router.home) == 0
    for w in range(20):
        first = call(Hints(f"w{w}", "a0"))
        assert r.pbkv_router.home[f"w{w}"] == first
        assert call(Hints(f"w{w}", "a1", done=True)) == first     # still sticky on its last call
    assert len(r.pbkv_router.home) == 0
