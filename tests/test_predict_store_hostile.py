"""A hostile tester's findings on where a predictor is saved (`pbkv.predict.store` and the
commands that save): a target inside a store, pruning after a rollback, `pbkv train` over a
served folder, dangling symlinks, `serve --no-online`, and `bench --predictor` during saves."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.predict import load_predictor, save_predictor, train_predictor
from pbkv.predict import store
from pbkv.predict.history import read_history
from pbkv.predict.store import check_target, live_dir
from pbkv.serve.learning import build_policy, finish_learning
from pbkv.trace import Call, Trace, TraceMeta

FLOWS = [[("plan", "task: alpha"), ("code", None), ("review", "looks fine")], [("plan", None), ("review", None)]]
TRACE = str(Path(__file__).parent / "data" / "chatdev-mini.jsonl")


@pytest.fixture(scope="module")
def predictor():
    calls = [Call(f"w{w}", s, a, 16, 1, [w * 10 + s], done=s == 2) for w in range(6)
             for s, a in enumerate(["plan", "code", "review"])]
    return train_predictor(Trace(TraceMeta(), calls), epochs=1, seed=0)


def versions(path: Path) -> list[str]:
    return sorted(e.name for e in path.iterdir() if e.name.startswith("v"))


def flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())   # typer's error box, unwrapped


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---- repro 16: serve --no-online only reads --predictor

def test_serve_without_online_learning_neither_needs_nor_does_a_write(predictor, tmp_path):
    store_dir = save_predictor(predictor, tmp_path / "P", history=FLOWS)
    (store_dir / ".lock").unlink()
    (store_dir / ".lock").mkdir()                            # stands in for a folder no save can write
    before = snapshot(store_dir)
    with pytest.raises(ValueError, match=r"\.lock: is a folder.*pass --no-online to serve it read-only"):
        build_policy("pbkv", 16, predictor_dir=store_dir, online=True)
    setup = build_policy("pbkv", 16, predictor_dir=store_dir, online=False)
    assert setup.loaded and setup.history == FLOWS
    assert finish_learning(setup) is None and setup.save_error is None
    assert snapshot(store_dir) == before and versions(store_dir) == ["v000001"]
