"""Predictor saves are atomic: a writer killed (kill -9) at any step leaves the old predictor or
the new one, each complete; stale temporaries of killed writers are removed by the next save."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pbkv.predict import has_predictor, load_predictor, save_predictor, train_predictor
from pbkv.predict.store import live_dir
from pbkv.trace import Call, Trace, TraceMeta

STEPS = ["config.json", "renamed", "pointed"]  # between two files; new version complete but not live; live
SRC = str(Path(__file__).resolve().parents[1] / "src")

# The child loads predictor A, makes B (every weight + 1, info gen=B), and saves B over the
# directory, pausing after the step named by argv[3]: it prints PAUSED and waits to be killed.
CHILD = textwrap.dedent("""
    import sys, torch
    from pbkv.predict import load_predictor, save_predictor
    from pbkv.predict import store
    src, dst, pause = sys.argv[1:4]
    p = load_predictor(src)
    with torch.no_grad():
        for t in p.net.parameters():
            t.add_(1.0)
    p.info = {"gen": "B"}
    def on_step(step):
        if step == pause:
            print("PAUSED", step, flush=True)
            sys.stdin.read()  # never returns: the parent kills this process here
    store.on_step = on_step
    save_predictor(p, dst)
    print("DONE", flush=True)
""")


def tiny_trace() -> Trace:
    calls = []
    for w in range(12):
        agents = ["plan", "code", "review"] if w % 2 else ["plan", "review"]
        for s, a in enumerate(agents):
            calls.append(Call(workflow_id=f"w{w}", step=s, agent=a, input_length=16, output_length=1,
                              hash_ids=[w * 10 + s], done=s == len(agents) - 1))
    return Trace(meta=TraceMeta(), calls=calls)


@pytest.fixture(scope="module")
def predictor_a(tmp_path_factory):
    p = train_predictor(tiny_trace(), epochs=1, seed=0)
    p.info = {"gen": "A"}
    return save_predictor(p, tmp_path_factory.mktemp("a") / "model")


def weights(p) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in p.net.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_at(step: str, src: Path, dst: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst), step], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_writer_killed_at_any_step_leaves_old_or_new_whole(predictor_a, tmp_path):
    a = load_predictor(predictor_a)
    wa = weights(a)
    wb = {k: (v + 1.0 if v.is_floating_point() and k in dict(a.net.named_parameters()) else v)
          for k, v in wa.items()}
    children = {}
    for step in STEPS:  # all started at once: their start-up (importing torch) overlaps
        dst = tmp_path / step
        save_predictor(a, dst)
        children[step] = (kill_at(step, predictor_a, dst), dst)
    for step, (child, dst) in children.items():
        line = child.stdout.readline()
        assert line.split() == ["PAUSED", step], line
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        child.stdout.close()
        child.stdin.close()
        loaded = load_predictor(dst)
        expect_new = step == "pointed"
        assert loaded.info["gen"] == ("B" if expect_new else "A"), step
        assert same(weights(loaded), wb if expect_new else wa), step
        # the next save removes the killed writer's temporaries; the live and previous versions stay
        save_predictor(a, dst)
        names = sorted(p.name for p in dst.iterdir() if p.name != ".lock")
        assert not [n for n in names if "tmp" in n], (step, names)
        assert names[0] == "CURRENT" and len(names) <= 3, (step, names)
        assert same(weights(load_predictor(dst)), wa)


def test_saves_by_two_processes_run_one_after_the_other(predictor_a, tmp_path):
    """Unlocked, a save pausing between its rename and its prune let another save point CURRENT at
    a version the first then pruned. Now a save waits for the one in progress (DIR/.lock), and a
    writer killed while holding it does not block the next."""
    a = load_predictor(predictor_a)
    dst = tmp_path / "model"
    save_predictor(a, dst)
    child = kill_at("renamed", predictor_a, dst)
    assert child.stdout.readline().split() == ["PAUSED", "renamed"]
    with open(dst / ".lock", "a") as handle:  # the paused writer holds the lock
        with pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    a.info = {"gen": "C"}
    saver = threading.Thread(target=save_predictor, args=(a, dst))
    saver.start()
    assert load_predictor(dst).info["gen"] == "A"  # not pointed yet: the paused writer is first
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    child.stdout.close()
    child.stdin.close()
    saver.join(timeout=60)
    assert not saver.is_alive()
    assert live_dir(dst).is_dir() and load_predictor(dst).info["gen"] == "C"


def test_flat_directory_loads_and_the_first_versioned_save_replaces_it(predictor_a, tmp_path):
    a = load_predictor(predictor_a)
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in live_dir(predictor_a).iterdir():
        (flat / f.name).write_bytes(f.read_bytes())
    (flat / "workflows.json").write_text('{"format": 1, "workflows": []}')   # saved with a history
    assert has_predictor(flat) and live_dir(flat) == flat
    assert load_predictor(flat).info["gen"] == "A"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".flat.tmp{dead.pid}"     # the temp folder of the earlier save_atomic
    stale.mkdir()
    alive = tmp_path / f".flat.tmp{os.getpid()}"  # a live writer's: never touched
    alive.mkdir()
    save_predictor(a, flat)
    assert sorted(p.name for p in flat.iterdir()) == [".lock", "CURRENT", "v000001"]
    assert not stale.exists() and alive.exists()
    pa, pb = (p.predict(["plan"]) for p in (a, load_predictor(flat)))
    assert np.array_equal(pa.probs, pb.probs)


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(predictor_a, tmp_path):
    a = load_predictor(predictor_a)
    mine = tmp_path / "mine"
    (mine / "v000001").mkdir(parents=True)
    (mine / "v000001" / "keep.txt").write_text("d")
    (mine / "config.json").write_text('{"my": 1}')     # a JSON file of the user's, not a predictor's
    (mine / "markov.json").write_text("x")
    with pytest.raises(ValueError, match=r"mine: holds other files \(config.json, markov.json, v000001\) "
                                         r"and no saved predictor; .* give a new or empty folder"):
        save_predictor(a, mine)
    assert sorted(p.name for p in mine.rglob("*")) == ["config.json", "keep.txt", "markov.json", "v000001"]
    empty = tmp_path / "empty"
    empty.mkdir()
    save_predictor(a, empty)                           # an empty folder, and a saved one, are fine
    save_predictor(a, empty)
    assert sorted(p.name for p in empty.iterdir()) == [".lock", "CURRENT", "v000001", "v000002"]


def test_the_flat_format_name_is_the_predictors():
    from pbkv.predict import history, predictor, store
    assert store.FLAT_FORMAT == predictor.FORMAT
    assert history.FILE in store.FLAT_FILES and store.FLAT_FILES[-1] == "config.json"


def test_train_refuses_a_folder_of_other_files_before_training(tmp_path):
    from typer.testing import CliRunner

    from pbkv.cli import app
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["train", "--trace", str(Path(__file__).parent / "data" / "chatdev-mini.jsonl"),
                                      "-o", str(tmp_path), "--epochs", "1"])
    assert result.exit_code == 2 and "holds other files (notes.txt)" in " ".join(result.output.replace("│", " ").split())
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_serve_refuses_at_start_a_predictor_folder_it_would_overwrite_on_shutdown(tmp_path):
    from pbkv.serve.learning import build_policy
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds other files \(notes.txt\)"):
        build_policy("pbkv", 16, predictor_dir=tmp_path, online=True)
    assert build_policy("pbkv", 16, predictor_dir=tmp_path / "new", online=True).predictor_dir == tmp_path / "new"


def test_the_same_predictor_saves_to_the_same_bytes(predictor_a, tmp_path):
    """Before: safetensors wrote the two metadata keys in a random order, so two saves of the
    same weights differed in their header (1 save in 2, measured)."""
    files, p = set(), load_predictor(predictor_a)
    for i in range(8):
        save_predictor(p, tmp_path / str(i))
        files.add((live_dir(tmp_path / str(i)) / "model.safetensors").read_bytes())
    assert len(files) == 1


def test_a_saved_predictor_follows_the_umask(predictor_a, tmp_path):
    """Before: model.safetensors was 0600 (safetensors' save_file), the other files 0644: a server
    under another account read config.json and failed on the weights (Permission denied)."""
    old = os.umask(0o022)
    try:
        save_predictor(load_predictor(predictor_a), tmp_path / "p")
    finally:
        os.umask(old)
    live = live_dir(tmp_path / "p")
    modes = {f.name: f.stat().st_mode & 0o777 for f in live.iterdir()}
    assert modes == dict.fromkeys(["config.json", "markov.json", "model.safetensors"], 0o644)
    assert live.stat().st_mode & 0o777 == 0o755
