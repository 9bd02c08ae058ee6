"""examples/bayes_policies.py: the spec's exact next-agent distributions, the posterior over a
workflow's hidden task, and both diagnostic policies running a small replay (the docs' "What
limits pbkv: the predictions" uses them)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile
from pbkv.policy.pbkv import PBKVPolicy
from pbkv.policy.registry import policy_class
from pbkv.workloads import generate, load_spec, runs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def bayes():
    sys.path.insert(0, str(EXAMPLES))
    import bayes_policies
    yield bayes_policies
    sys.path.remove(str(EXAMPLES))


def test_given_the_task_the_next_agents_follow_the_spec_by_hand(bayes):
    b = bayes.SpecBayes("hover", horizon=3)
    task = {"hops": 4, "evidence": "clean"}
    # after planner, retriever, summarizer, verifier: one hop of four done, so the verifier goes
    # to the retriever (p .9), the planner (.03) or the judge (.05), normalised by their sum
    p = b.given(task, ["planner", "retriever", "summarizer", "verifier"])
    row = dict(zip(p.agents, p.probs[0]))
    assert row["retriever"] == pytest.approx(0.9 / 0.98) and row["judge"] == pytest.approx(0.05 / 0.98)
    assert row["planner"] == pytest.approx(0.03 / 0.98)
    # the judge ends the workflow with p .94 (clean evidence, first visit): survival drops
    assert p.survival[0] == 1.0 and p.survival[1] == pytest.approx(1 - 0.05 / 0.98 * 0.94)
    assert dict(zip(p.agents, p.probs[1]))["summarizer"] > 0.9
    np.testing.assert_allclose(p.probs.sum(axis=1), 1.0)


def test_posterior_sums_to_one_and_follows_the_words_and_the_history(bayes):
    b = bayes.SpecBayes("hover", horizon=2)
    post = b.posterior("task: x (a four-entity claim; obscure subjects) | agent: planner", ["planner"])
    assert sum(w for w, _ in post) == pytest.approx(1.0)
    best = max(post, key=lambda wt: wt[0])[1]
    assert best == {"hops": 4, "evidence": "noisy"}
    # the same words after three hops without a judge: the history moves the posterior (with
    # two hops the verifier would most likely have called the judge by now)
    later = b.posterior("task: x (a four-entity claim; obscure subjects) | agent: planner",
                        ["planner", "retriever", "summarizer", "verifier"] * 3)
    assert dict((tuple(t.items()), w) for w, t in later) != dict((tuple(t.items()), w) for w, t in post)


def test_true_task_is_the_generator_s(bayes):
    spec = load_spec("swe")
    truth = {r.calls[0].workflow_id: r.task for r in runs(spec, 6, 2)}
    b = bayes.SpecBayes("swe", horizon=3)
    assert all(b.true_task(w) == t for w, t in reversed(truth.items()))


@pytest.mark.parametrize("name", ["FromWords", "FromTask"])
def test_each_diagnostic_is_pbkv_with_other_predictions_and_runs(bayes, name):
    cls = policy_class(f"bayes_policies:{name}")
    assert issubclass(cls, PBKVPolicy) and cls.reads_future
    spec = load_spec("hover")
    workload = Workload("hover", generate(spec, 16, 3), spec.edges())
    r = simulate(workload, RunConfig(policy=f"bayes_policies:{name}", concurrency=8,
                                     profile=load_profile("a6000-qwen3-32b"), cache=CacheConfig(12000, 12000, 0)))
    assert r["calls"] == sum(map(len, workload.workflows))
    assert 0 < r["recomputed_tokens"] <= r["prompt_tokens"]


def _renamed(workflows, name):
    """The workflows with their ids' spec part renamed (as `pbkv gen` of a spec file names them)."""
    from dataclasses import replace
    return [[replace(c, workflow_id=name + "-" + c.workflow_id.split("-", 1)[1]) for c in w] for w in workflows]


def test_a_replay_that_is_not_one_built_in_workload_fails_at_construction_in_one_line(bayes):
    """A trace mixing generated workloads crashed with a bare KeyError (an agent of the second spec
    looked up in the first's), a spec-file workload with "<name>: not a built-in workload" naming
    neither the policy nor why; both only once the policy's predictions ran."""
    hover = Workload("hover", generate(load_spec("hover"), 2, 0)).workflows
    swe = Workload("swe", generate(load_spec("swe"), 2, 0)).workflows
    assert bayes.replay_spec(hover) == "hover"
    with pytest.raises(bayes.SpecMismatch) as e:
        bayes.replay_spec(hover + swe)
    assert str(e.value) == ("bayes_policies: workflow 'swe-0-00000': from workload 'swe', but the replay began "
                            "with 'hover'; one replay must be one generated workload")
    with pytest.raises(bayes.SpecMismatch) as e:
        bayes.replay_spec(_renamed(hover, "myhover"))
    assert str(e.value) == ("bayes_policies: workflow 'myhover-0-00000': 'myhover' is not a built-in workload "
                            "(dialogue, finance, hover, swe); a workload generated from a spec file or a "
                            "recorded trace has no spec these policies can read")
    with pytest.raises(bayes.SpecMismatch) as e:
        bayes.replay_spec(_renamed(swe, "hover"))
    assert str(e.value).startswith("bayes_policies: workflow 'hover-0-00000': calls agent(s) ")
    assert str(e.value).endswith(" that spec 'hover' does not have")


def test_the_mixed_replay_is_refused_before_any_call_is_simulated(bayes):
    spec = load_spec("hover")
    trace = generate(spec, 2, 0)
    swe = generate(load_spec("swe"), 1, 0)
    from dataclasses import replace
    trace = replace(trace, calls=trace.calls + [replace(c, hash_ids=[h + 10**6 for h in c.hash_ids])
                                                for c in swe.calls])
    with pytest.raises(bayes.SpecMismatch, match="^bayes_policies: workflow 'swe-0-00000': from workload 'swe'"):
        simulate(Workload("mixed", trace), RunConfig(policy="bayes_policies:FromWords", concurrency=4,
                                                     profile=load_profile("a6000-qwen3-32b"),
                                                     cache=CacheConfig(12000, 0, 0)))
