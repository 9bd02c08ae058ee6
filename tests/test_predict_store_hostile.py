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


# ---- repro 5: a version folder (or anything inside a store) is no save target

def test_a_folder_inside_a_store_is_refused_and_the_live_version_kept(predictor, tmp_path):
    store_dir = save_predictor(predictor, tmp_path / "P")
    save_predictor(predictor, store_dir)
    before = snapshot(store_dir)
    (tmp_path / "link").symlink_to(store_dir / "v000002")
    for target in (store_dir / "v000002", store_dir / "v000001", store_dir / "v000002" / "sub",
                   store_dir / "v000007", tmp_path / "link", store_dir / "v000002" / ".." / "v000001"):
        with pytest.raises(ValueError, match=f"inside a version folder of the predictor folder {store_dir}; "
                                             f".*give {store_dir} itself"):
            check_target(target)
    # beside a version, or beside the store written with `..`: not inside a version (hostile14 repro 2, 6)
    for target in (store_dir / "results", store_dir / "v000002" / ".." / "other", store_dir / ".." / "Q"):
        check_target(target)
    with pytest.raises(ValueError, match="inside a version folder"):
        save_predictor(predictor, store_dir / "v000002")
    assert snapshot(store_dir) == before and load_predictor(store_dir).agents == predictor.agents


def test_a_prune_never_deletes_the_files_of_a_live_version(predictor, tmp_path):
    """The second line of defence: even called on a live version folder, `_prune` keeps its files."""
    store_dir = save_predictor(predictor, tmp_path / "P")
    live = live_dir(store_dir)
    store._prune(live, "v000009", None)
    assert sorted(p.name for p in live.iterdir()) == ["config.json", "markov.json", "model.safetensors"]


def test_train_and_serve_refuse_a_version_folder_before_any_work(predictor, tmp_path):
    store_dir = save_predictor(predictor, tmp_path / "P")
    r = CliRunner().invoke(app, ["train", "--trace", TRACE, "-o", str(store_dir / "v000001"), "--epochs", "1"])
    assert r.exit_code == 2 and f"give {store_dir} itself" in flat(r.output)
    with pytest.raises(ValueError, match="inside a version folder.*--no-online"):
        build_policy("pbkv", 16, predictor_dir=store_dir / "v000001", online=True)
    # serving an older version read-only (a rollback without editing CURRENT) is fine: nothing is saved
    setup = build_policy("pbkv", 16, predictor_dir=store_dir / "v000001", online=False)
    assert setup.loaded and finish_learning(setup) is None
    assert versions(store_dir) == ["v000001"]


# ---- repro 15: pruning keeps the version CURRENT named before the save

def test_after_a_rollback_the_next_save_keeps_the_version_rolled_back_to(predictor, tmp_path):
    store_dir = tmp_path / "P"
    for _ in range(3):
        save_predictor(predictor, store_dir)
    assert versions(store_dir) == ["v000002", "v000003"]
    (store_dir / "CURRENT").write_text("v000002\n")          # v000003 was bad: roll back by hand
    save_predictor(predictor, store_dir)
    assert versions(store_dir) == ["v000002", "v000004"]
    assert (store_dir / "CURRENT").read_text() == "v000004\n"
    save_predictor(predictor, store_dir)                     # then as usual: the new one and the one before
    assert versions(store_dir) == ["v000004", "v000005"]


# ---- repro 7: pbkv train over a folder servers saved into keeps their workflows

def test_train_into_a_served_folder_carries_the_learned_workflows(predictor, tmp_path):
    from pbkv.cli.predict import _save_keeping_history
    store_dir = save_predictor(predictor, tmp_path / "P", history=FLOWS)
    assert _save_keeping_history(predictor, store_dir) == len(FLOWS)
    assert _save_keeping_history(predictor, store_dir) == len(FLOWS)   # the version holding them is pruned now
    assert versions(store_dir) == ["v000002", "v000003"] and read_history(store_dir) == FLOWS
    assert _save_keeping_history(predictor, tmp_path / "new") == 0
    assert not (live_dir(tmp_path / "new") / "workflows.json").exists()


def test_train_says_an_unreadable_history_is_not_carried(predictor, tmp_path, capsys):
    from pbkv.cli.predict import _save_keeping_history
    store_dir = save_predictor(predictor, tmp_path / "P", history=FLOWS)
    (live_dir(store_dir) / "workflows.json").write_text("{")
    assert _save_keeping_history(predictor, store_dir) == 0
    assert "not carried over" in capsys.readouterr().err
    assert load_predictor(store_dir).agents == predictor.agents


# ---- repro 12: a dangling symlink is refused up front

def test_a_dangling_symlink_is_refused_before_any_work(tmp_path):
    link = tmp_path / "plink"
    link.symlink_to(tmp_path / "not-created-yet")
    for target in (link, link / "sub"):
        with pytest.raises(ValueError, match=f"{link} is a symlink to a missing folder"):
            check_target(target)
    r = CliRunner().invoke(app, ["train", "--trace", TRACE, "-o", str(link), "--epochs", "1"])
    assert r.exit_code == 2 and "symlink to a missing folder" in flat(r.output)
    with pytest.raises(ValueError, match="symlink to a missing folder"):
        build_policy("pbkv", 16, predictor_dir=link, online=True)
    check_target(tmp_path / "fine" / "deeper")               # plain new folders are still fine


def test_a_new_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile is a file"):
        check_target(tmp_path / "afile" / "P")


# ---- repro 16: serve --no-online only reads --predictor

def test_serve_without_online_learning_neither_needs_nor_does_a_write(predictor, tmp_path):
    store_dir = save_predictor(predictor, tmp_path / "P", history=FLOWS)
    (store_dir / ".lock").unlink()
    (store_dir / ".lock").mkdir()                            # stands in for a folder no save can write
    before = snapshot(store_dir)
    with pytest.raises(ValueError, match=r"\.lock: is a folder.*pass --no-online to serve it read-only"):
        build_policy("pbkv", 16, predictor_dir=store_dir, online=True)
    setup = build_policy("pbkv", 16, predictor_dir=store_dir, online=False)
    assert setup.loaded and setup.history == []   # the learning history is not even read
    assert finish_learning(setup) is None and setup.save_error is None
    assert snapshot(store_dir) == before and versions(store_dir) == ["v000001"]


# ---- repro 17: bench --predictor copies the live version once and records it

def test_bench_workers_all_load_a_copy_of_the_version_live_when_the_run_began(predictor, tmp_path):
    from pbkv.bench import predictors as pm
    from pbkv.bench.main import _record_version
    store_dir = save_predictor(predictor, tmp_path / "P")
    source = SimpleNamespace(name="w", spec=None, trace="x.jsonl", workflows=0, seed=0)
    out = tmp_path / "out" / "models"
    paths = pm.prepare([source], ["lru", "pbkv"], pm.PredictorSource(predictor=str(store_dir)), out)
    assert paths == {("w", "fused"): str(out / "predictor" / "v000001")}
    for _ in range(3):
        save_predictor(predictor, store_dir)                 # a server saving meanwhile: v000001 is pruned
    assert not (store_dir / "v000001").exists() and load_predictor(paths[("w", "fused")]).agents == predictor.agents
    records = [{"policy": "lru"}, {"policy": "pbkv"}]
    _record_version(records, pm.version_name(paths))
    assert records == [{"policy": "lru"}, {"policy": "pbkv", "predictor_version": "v000001"}]


def test_bench_records_no_version_without_a_predictor_folder(predictor, tmp_path):
    """The default bench (cached predictors, themselves versioned folders) and a flat --predictor
    add no key: their bench.json is unchanged."""
    from pbkv.bench import predictors as pm
    cached = save_predictor(predictor, tmp_path / "cache")
    assert pm.version_name({("w", "fused"): str(cached)}) is None
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    for f in live_dir(cached).iterdir():
        os.link(f, flat_dir / f.name)
    copy = pm.snapshot(str(flat_dir), tmp_path / "out")
    assert copy == str(tmp_path / "out" / "predictor" / "flat") and load_predictor(copy)
    assert pm.version_name({("w", "fused"): copy}) is None


def test_an_earlier_runs_copy_given_back_as_predictor_is_used_not_deleted(predictor, tmp_path):
    """bench.json names the version a run used and its copy lies in OUT/models/predictor/; given
    back as --predictor with the same --out, the copy was deleted before being copied (every
    file gone, then a load error naming an empty folder)."""
    from pbkv.bench import predictors as pm
    store_dir = save_predictor(predictor, tmp_path / "P")
    out = tmp_path / "out" / "models"
    first = pm.snapshot(str(store_dir), out)
    again = pm.snapshot(first, out)
    assert again == first and load_predictor(again).agents == predictor.agents


def test_serve_refuses_a_predictor_folder_it_would_neither_read_nor_write(predictor, tmp_path):
    """--no-online with a folder holding no predictor (a typo) ran on an empty Markov chain and
    saved nothing; a policy reading no predictor ignored --predictor."""
    with pytest.raises(ValueError, match=r"typo.*holds no saved predictor, and with --no-online nothing is learned"):
        build_policy("pbkv", 16, predictor_dir=tmp_path / "typo", online=False)
    saved = save_predictor(predictor, tmp_path / "p")
    for policy in ("lru", "kvflow"):
        with pytest.raises(ValueError, match=rf"--predictor .*p: policy {policy} reads no trained predictor \(policies that do: pbkv, "):
            build_policy(policy, 16, predictor_dir=saved, online=False)
    assert build_policy("pbkv", 16, predictor_dir=saved, online=False).loaded
