"""Online learning when things go wrong: signals meant for the server, a retrain that fails, a
first save killed before its pointer, a session too short to save, messages an operator sees."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile

import pytest

from pbkv.predict import has_predictor, load_predictor, save_predictor, train_predictor
from pbkv.predict.store import check_target
from pbkv.serve.learning import TrafficLearner, build_policy, finish_learning, start_pool
from pbkv.serve.server import log_to_stderr
from pbkv.trace import Call, Trace, TraceMeta

from test_predict_save import kill_at


def _handlers():
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_the_retrain_process_ignores_the_signals_that_stop_the_server_gracefully():
    """Ctrl-C (SIGINT) or a service stop (SIGTERM) reach the whole process group; the server
    waits for the retrain and saves it, so the retrain must survive them."""
    pool, lifeline = start_pool(0)
    try:
        assert pool.submit(_handlers).result(timeout=120) == (signal.SIG_IGN, signal.SIG_IGN)
    finally:
        pool.shutdown()
        lifeline.close()


def test_a_failed_retrain_is_logged_and_counted_and_a_dead_servers_temp_folder_removed(tmp_path, monkeypatch,
                                                                                        caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"pbkv-learn-{dead.pid}-abc"
    stale.mkdir()
    learner = TrafficLearner(background=True)
    learner.nice = 0
    try:
        with caplog.at_level(logging.ERROR, logger="pbkv.serve"):
            learner._train([])                       # nothing to train on: the child raises ValueError
    finally:
        learner.close()
    assert learner.dropped == 1 and learner.retrains == 0 and learner._ready is None
    assert "a retrain failed (ValueError: no workflows to train on)" in caplog.text
    assert not stale.exists() and not list(tmp_path.glob("pbkv-learn-*"))


def test_a_first_save_killed_between_rename_and_pointer_leaves_a_usable_folder(tmp_path):
    calls = [Call(f"w{w}", s, a, 16, 1, [w * 10 + s], done=s == 1) for w in range(6)
             for s, a in enumerate(["plan", "code"])]
    src = save_predictor(train_predictor(Trace(TraceMeta(), calls), epochs=1, seed=0), tmp_path / "src")
    dst = tmp_path / "new"
    child = kill_at("renamed", src, dst)
    assert child.stdout.readline().split() == ["PAUSED", "renamed"]
    child.kill()
    child.wait(timeout=30)
    child.stdout.close()
    child.stdin.close()
    assert not has_predictor(dst)            # the killed save never made its version live
    check_target(dst)                         # but the folder is not refused as one of other files
    setup = build_policy("pbkv", 16, predictor_dir=dst, online=True)
    assert not setup.loaded
    save_predictor(load_predictor(src), dst)
    assert load_predictor(dst).agents == load_predictor(src).agents


def test_a_session_too_short_to_train_says_its_workflows_are_not_kept(tmp_path, caplog):
    setup = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    for w in range(3):
        setup.learner.add(["plan", "code"], [None, None])
    with caplog.at_level(logging.WARNING, logger="pbkv.serve"):
        assert finish_learning(setup) is None
    assert "nothing saved to" in caplog.text and "(3 did)" in caplog.text
    assert not (tmp_path / "p").exists()


def test_the_servers_own_messages_are_shown_at_its_log_level(capsys):
    logger = logging.getLogger("pbkv")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers = []
    try:
        log_to_stderr("info")
        logging.getLogger("pbkv.serve").info("saved the predictor to %s", "D")
        logging.getLogger("pbkv.serve").debug("not shown")
    finally:
        logger.handlers, logger.level, logger.propagate = saved
    err = capsys.readouterr().err
    assert "saved the predictor to D" in err and "INFO" in err and "not shown" not in err


@pytest.mark.parametrize("floor, saved", [(0, True), (50, False)])
def test_a_used_background_retrain_is_saved_at_once_so_a_killed_server_keeps_it(tmp_path, floor, saved):
    """Before: only the graceful shutdown saved, so a SIGKILLed server (or a replica Ray replaced)
    lost all it had learned. A retrain below the floor (fewer workflows than the loaded
    predictor) is not used, so it is not saved either."""
    from pbkv.predict.history import read_history
    folder = tmp_path / "p"
    setup = build_policy("pbkv", 16, folder, learn_every=6, learn_steps=20, learn_nice=0)
    learner = setup.learner
    learner.floor = floor
    try:
        for w in range(6):
            learner.add(["plan", "code", "test"] if w % 2 else ["plan", "code"], [None, None, None][:2 + w % 2])
        assert learner.poll() is None and learner._thread is not None   # the retrain started
        learner._thread.join(timeout=300)
        assert has_predictor(folder) is saved                           # no shutdown, no finish_learning
        if saved:
            assert {"plan", "code", "test"} <= set(load_predictor(folder).agents)
            assert [[a for a, _ in wf] for wf in read_history(folder)] == [["plan", "code"], ["plan", "code", "test"]] * 3
            setup.policy.predictor = learner.poll()                     # as the policy takes it up
            learner.add(["plan"], [None])
            finish_learning(setup)                                      # the shutdown save adds only the new one
            assert [[a for a, _ in wf] for wf in read_history(folder)] == [["plan", "code"], ["plan", "code", "test"]] * 3 + [["plan"]]
    finally:
        learner.close(kill=True)
