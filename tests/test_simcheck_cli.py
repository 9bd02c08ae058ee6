"""`pbkv simcheck`'s command line: a bad --policies or --workflows is refused before calibrating or
replaying anything (exit 2, one error line), and the title says what was replayed."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import pbkv.bench.simcheck
from pbkv.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def no_work(monkeypatch):
    """Calibrating or replaying fails the test: the command line must be refused before."""
    def never(*_a, **_k):
        raise AssertionError("worked before the command line was checked")
    monkeypatch.setattr(pbkv.bench.simcheck, "get_model", never)
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", never)


@pytest.mark.parametrize("policies, message", [
    ("", "--policies: give at least one policy"),
    (",", "--policies: give at least one policy"),
    ("lru,lru", "--policies: lru given twice"),
    ("lru,nope", "unknown policy 'nope'"),
])
def test_simcheck_refuses_bad_policies_before_any_work(tmp_path, no_work, policies, message):
    r = invoke("simcheck", "--model", "tiny", "--workflows", 2, "--concurrency", 1, "--policies", policies,
               "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert message in flat(r.output)
    assert "Traceback" not in r.output and "IndexError" not in r.output


TRACE = "tests/data/chatdev-mini.jsonl"  # 3 workflows


def fake_rows(policies):
    row = {"device_tokens": 100, "host_tokens": 200, "disk_tokens": 800}
    for key, _, _ in pbkv.bench.simcheck.COMPARED:
        row[f"real_{key}"] = row[f"sim_{key}"] = 1.0
    return [{**row, "policy": p} for p in policies]


def test_simcheck_refuses_workflows_with_a_trace(no_work):
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", TRACE, "--workflows", 1,
               "--policies", "lru", "--concurrency", 1)
    assert r.exit_code == 2, r.output
    assert "--workflows applies to generated workloads" in flat(r.output) and "3 workflows" in flat(r.output)


def test_simcheck_title_counts_the_workflows_of_the_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", lambda source, policies, *a, **k: fake_rows(policies))
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", TRACE, "--policies", "lru",
               "--concurrency", 1, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "chatdev-mini.jsonl x3," in r.output and " x8," not in r.output


def test_simcheck_title_counts_the_generated_workflows(tmp_path, monkeypatch):
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", lambda source, policies, *a, **k: fake_rows(policies))
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", "hover", "--workflows", 2,
               "--policies", "lru", "--concurrency", 1, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "hover x2," in r.output
