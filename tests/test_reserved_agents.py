"""Agent names the predictor reserves ("<unk>", "<end>") are refused where a trace is learned
from, naming the file, workflow and step, and a served call's agent hint of that name is put in
parentheses: as is it would collide with the unknown class or the end of the workflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pbkv.predict import fit_markov, train_predictor
from pbkv.serve.workflows import Hints, WorkflowTable
from pbkv.trace import read_trace

TRACE = Path(__file__).parent / "data" / "chatdev-mini.jsonl"


def renamed(tmp_path: Path, name: str) -> Path:
    """chatdev-mini with the agent of its first call named `name`."""
    lines = TRACE.read_text().splitlines()
    first = json.loads(lines[1])
    lines[1] = json.dumps({**first, "agent": name})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", ["<unk>", "<end>"])
@pytest.mark.parametrize("fit", [train_predictor, fit_markov], ids=["train", "markov"])
def test_training_refuses_a_reserved_agent_name(tmp_path, name, fit):
    path = renamed(tmp_path, name)
    with pytest.raises(ValueError, match=rf"t.jsonl: workflow 'chatdev-a' step 0: agent name '{name}' is reserved"):
        fit(read_trace(path))


@pytest.mark.parametrize("name", ["<unk>", "<end>"])
def test_a_served_reserved_agent_name_is_put_in_parentheses(name):
    table = WorkflowTable()
    run, _, _ = table.begin(Hints("w", name), 0.0)
    assert run.agents == [f"({name})"]


def test_served_agent_names_stay_distinct():
    """Before: a client's "(<end>)" merged with its "<end>", and its "other" with the calls past
    max_agents; each distinct client name now stays a distinct agent."""
    table = WorkflowTable(max_agents=6)
    names = ["<end>", "(<end>)", "((<end>))", "other", "(other)", "(x)"]
    run, _, _ = table.begin(Hints("w", names[0]), 0.0)
    for n in names[1:] + ["past-the-cap"]:
        table.begin(Hints("w", n), 0.0)
    assert run.agents == ["(<end>)", "((<end>))", "(((<end>)))", "(other)", "((other))", "(x)", "other"]


def test_bench_refuses_a_replayed_reserved_agent_name_before_any_run(tmp_path):
    """Before: `bench --online` died at its first retrain, naming a workflow 'online-0' that is in
    no file, and `bench --predictor` replayed agent "<end>" as the workflow's end (hostile14)."""
    from typer.testing import CliRunner

    from pbkv.cli import app
    path = renamed(tmp_path, "<end>")
    args = ["bench", "--trace", str(path), "--concurrency", "2", "--device-tokens", "4000", "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(app, [*args, "--policies", "pbkv"])
    assert r.exit_code == 2 and "t.jsonl: workflow 'chatdev-a' step 0: agent name '<end>' is reserved" in r.output
    assert not (tmp_path / "o").exists()
    assert "reserved" not in CliRunner().invoke(app, [*args, "--policies", "kvflow"]).output   # no predictor: fine
