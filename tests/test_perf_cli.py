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
    assert "--predictor: lru uses no predictor" in flat(r.output)


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
