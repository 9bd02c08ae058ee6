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
