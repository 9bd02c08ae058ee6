"""`pbkv perf sim|policy|evict --predictor`: a missing predictor, or one the policy does not use, is
refused before any work (exit 2), as `pbkv bench` refuses a missing one."""

from __future__ import annotations

from pathlib import Path

import pytest

import pbkv.bench.perf
from helpers import flat, invoke



@pytest.fixture
def no_work(monkeypatch):
    for name in ("sim_speed", "policy_overhead", "evict_speed"):
        monkeypatch.setattr(pbkv.bench.perf, name, lambda *a, **k: pytest.fail("measured"))


COMMANDS = [("sim", "--workflows", 3, "--concurrency", 2), ("policy", "--workflows", 3, "--concurrency", 2),
            ("evict", "--nodes", 1100)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("policy", ["lru", "pbkv"])
def test_perf_refuses_a_missing_predictor(tmp_path, no_work, command, policy):
    missing = tmp_path / "no-such-dir"
    r = invoke("perf", *command, "--policy", policy, "--predictor", missing)
    assert r.exit_code == 2, r.output
    assert f"{missing}: no such file or directory" in flat(r.output) and "Traceback" not in r.output


@pytest.mark.parametrize("command", COMMANDS)
def test_perf_refuses_a_predictor_the_policy_does_not_use(tmp_path, no_work, command):
    r = invoke("perf", *command, "--policy", "lru", "--predictor", tmp_path)
    assert r.exit_code == 2, r.output
    assert ("--predictor: lru reads no trained predictor (policies that do: pbkv, pbkv-noprefetch, pbkv-history, "
            "pbkv-context); leave --predictor out") in flat(r.output)


def test_perf_refuses_an_unknown_policy_with_one_line(tmp_path, no_work):
    r = invoke("perf", "sim", "--policy", "nope", "--predictor", tmp_path)
    assert r.exit_code == 2 and "unknown policy 'nope'" in flat(r.output) and "Traceback" not in r.output


def test_perf_refuses_a_predictor_of_another_variant_than_the_policy_reads(tmp_path):
    """A context predictor given to policy pbkv (fused) would be measured as pbkv's."""
    from pbkv.predict import save_predictor, train_predictor
    from pbkv.trace import read_trace
    trace = read_trace(Path(__file__).parent / "data" / "chatdev-mini.jsonl")
    saved = save_predictor(train_predictor(trace, variant="context", horizon=2, epochs=1, seed=0), tmp_path / "ctx")
    r = invoke("perf", "evict", "--nodes", 1100, "--policy", "pbkv", "--predictor", saved)
    assert r.exit_code == 2, r.output
    assert "a context predictor (config.json variant 'context'); policy pbkv needs a fused one" in flat(r.output)


@pytest.mark.parametrize("policy", ["pbkv-retired", "pbkv-perfect"])
def test_perf_says_which_policies_read_a_predictor(tmp_path, no_work, policy):
    """It said "pbkv-retired uses no predictor (the pbkv policies do)", calling a pbkv policy not one."""
    r = invoke("perf", "sim", "--workflows", 2, "--policy", policy, "--predictor", tmp_path)
    assert r.exit_code == 2, r.output
    assert flat(r.output).strip() == (f"error: --predictor: {policy} reads no trained predictor (policies that do: "
                                      f"pbkv, pbkv-noprefetch, pbkv-history, pbkv-context); leave --predictor out")


def test_perf_evict_nodes_has_an_upper_bound(no_work):
    r = invoke("perf", "evict", "--nodes", 10**12)
    assert r.exit_code == 2 and "Traceback" not in r.output and "MemoryError" not in r.output
    assert "Invalid value for '--nodes': Input should be less than or equal to 10000000" in flat(r.output)


@pytest.fixture(scope="module")
def chatdev_predictor(tmp_path_factory):
    from pbkv.predict import save_predictor, train_predictor
    from pbkv.trace import read_trace
    trace = read_trace(Path(__file__).parent / "data" / "chatdev-mini.jsonl")
    return save_predictor(train_predictor(trace, variant="fused", horizon=2, epochs=1, seed=0),
                          tmp_path_factory.mktemp("pred") / "chatdev")


def test_perf_evict_refuses_a_predictor_that_knows_none_of_its_agents(chatdev_predictor):
    """perf evict's workflows call a0..a4: a trained predictor predicted each as the unknown agent
    while the figure named it ("(pbkv; predictor: DIR)"), silently."""
    r = invoke("perf", "evict", "--nodes", 1100, "--policy", "pbkv", "--predictor", chatdev_predictor)
    assert r.exit_code == 2, r.output
    assert flat(r.output).strip() == (
        f"error: --predictor {chatdev_predictor}: perf evict's synthetic workflows call agents a0, a1, a2, a3, a4, "
        f"and this predictor never saw a0, a1, a2, a3, a4: every such prediction would be the unknown agent's; "
        f"leave --predictor out (a Markov predictor fitted on the synthetic workflows is used)")


@pytest.mark.parametrize("command", ["sim", "policy"])
def test_perf_notes_replayed_agents_the_predictor_never_saw(chatdev_predictor, command):
    r = invoke("perf", command, "--workload", "hover", "--workflows", 3, "--concurrency", 2, "--policy", "pbkv",
               "--predictor", chatdev_predictor)
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith(f"note: hover: --predictor {chatdev_predictor}: ")
    assert first.endswith(" positions have an agent the predictors never saw (judge, planner, retriever, "
                          "summarizer, verifier); they score as an unknown agent")
