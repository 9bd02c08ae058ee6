"""The workflows a served predictor learned from are saved with it and start the next server's
learning window (`pbkv.predict.history`)."""

from __future__ import annotations

import json

import pytest

from pbkv.predict import load_predictor, save_predictor, train_predictor
from pbkv.predict.history import FILE, MAX_CONTEXT_CHARS, read_history
from pbkv.predict.online import OnlineLearner
from pbkv.predict.store import live_dir
from pbkv.serve.learning import build_policy, finish_learning
from pbkv.trace import Call, Trace, TraceMeta

FLOWS = [[("plan", "task: alpha"), ("code", None), ("review", "looks fine")], [("plan", None), ("review", None)]]


@pytest.fixture(scope="module")
def predictor():
    calls = [Call(f"w{w}", s, a, 16, 1, [w * 10 + s], done=s == 2) for w in range(6)
             for s, a in enumerate(["plan", "code", "review"])]
    return train_predictor(Trace(TraceMeta(), calls), epochs=1, seed=0)


def test_history_is_saved_with_its_version_and_read_back(predictor, tmp_path):
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    assert read_history(tmp_path / "p") == FLOWS
    save_predictor(predictor, tmp_path / "p")                     # a version without one has none
    assert read_history(tmp_path / "p") == []
    assert not (live_dir(tmp_path / "p") / FILE).exists()


def test_contexts_are_cut_to_what_the_featurizer_reads(predictor, tmp_path):
    save_predictor(predictor, tmp_path / "p", history=[[("plan", "x" * (MAX_CONTEXT_CHARS + 50))]])
    assert read_history(tmp_path / "p") == [[("plan", "x" * MAX_CONTEXT_CHARS)]]


@pytest.mark.parametrize("body, message", [
    ("{", r"workflows.json: not JSON \(Expecting property name"),
    ('{"format": "other", "workflows": []}', r"workflows.json: not a pbkv-workflows file"),
    ('{"format": "pbkv-workflows", "workflows": [[["plan", 3]]]}',
     r'workflows.json: workflows.0: expected a non-empty list of \[agent, context or null\], got \[\["plan", 3\]\]'),
    ('{"format": "pbkv-workflows", "workflows": [[["plan", null]], []]}', r"workflows.1: expected a non-empty"),
    ('{"format": "pbkv-workflows", "workflows": [[["", null]]]}', r"workflows.0: expected"),
])
def test_a_damaged_history_is_an_error_naming_the_file_and_entry(predictor, tmp_path, body, message):
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    (live_dir(tmp_path / "p") / FILE).write_text(body)
    with pytest.raises(ValueError, match=message):
        read_history(tmp_path / "p")
    with pytest.raises(ValueError, match=message):                 # a server refuses to start on it
        build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)


def test_remembered_workflows_join_the_window_but_are_not_pending():
    learner = OnlineLearner(every=2)
    learner.add(["a", "b"], [None, "x"])
    learner.remember(FLOWS)
    assert learner.pending == 1 and learner.workflows() == [[("a", None), ("b", "x")], *FLOWS]
    assert len({wf[0].workflow_id for wf in learner.window}) == 3  # each its own workflow


def test_a_server_starts_its_window_with_the_saved_workflows_and_saves_them_again(predictor, tmp_path):
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    setup = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    assert setup.learner.workflows() == FLOWS and setup.learner.pending == 0
    setup.learner.add(["plan", "review"], ["task: beta", None])
    finish_learning(setup)                                         # too few for a retrain: kept, saved again
    assert read_history(tmp_path / "p") == [*FLOWS, [("plan", "task: beta"), ("review", None)]]
    assert json.loads((live_dir(tmp_path / "p") / "config.json").read_text())["info"] == predictor.info


def test_without_online_learning_the_saved_workflows_are_kept(predictor, tmp_path):
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    setup = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=False)
    assert setup.learner is None
    finish_learning(setup)
    assert read_history(tmp_path / "p") == FLOWS and load_predictor(tmp_path / "p").agents == predictor.agents


def test_two_servers_on_one_folder_keep_each_others_workflows(predictor, tmp_path):
    """Both start from the same version; A stops first. B's save keeps A's workflow (the
    predictor saved is B's): neither session's traffic is lost to the next server."""
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    a = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    b = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    a.learner.add(["plan"], ["from a"])
    b.learner.add(["review"], ["from b"])
    finish_learning(a)
    finish_learning(b)
    assert read_history(tmp_path / "p") == [*FLOWS, [("plan", "from a")], [("review", "from b")]]


def test_two_servers_keep_each_others_workflows_that_look_alike(predictor, tmp_path):
    """A fixed pipeline with templated prompts: both servers end the same-looking workflows.
    Matching by content dropped A's (5 of 10 kept); the folder now keeps all 10, once each."""
    save_predictor(predictor, tmp_path / "p", history=FLOWS)
    a = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    b = build_policy("pbkv", 16, predictor_dir=tmp_path / "p", online=True)
    for learner in (a.learner, b.learner):
        for _ in range(5):
            learner.add(["plan", "review"], ["task: same", None])
    finish_learning(a)
    finish_learning(b)
    same = [("plan", "task: same"), ("review", None)]
    assert read_history(tmp_path / "p") == [*FLOWS, *[same] * 10]


def test_merging_puts_ours_after_the_live_workflows_and_keeps_the_newest_window(predictor, tmp_path):
    from pbkv.predict.history import merge_with_live
    one, two = [("plan", None)], [("code", "x" * (MAX_CONTEXT_CHARS + 9))]
    save_predictor(predictor, tmp_path / "p", history=[one, two])
    cut = [("code", "x" * MAX_CONTEXT_CHARS)]                                    # saved cut
    assert merge_with_live(tmp_path / "p", [one], 10) == [one, cut, one]         # alike, yet another workflow
    assert merge_with_live(tmp_path / "p", [two, one], 2) == [two, one]          # the window keeps the newest
    assert merge_with_live(tmp_path / "empty", [one], 5) == [one]                # nothing saved yet


def test_a_save_whose_tidying_up_fails_is_live_and_its_workflows_are_not_saved_again(predictor, tmp_path,
                                                                                      monkeypatch, caplog):
    """The directory fsync or the prune failing after CURRENT moved was reported as a failed save:
    the server then counted those workflows as unsaved and the next save wrote them twice."""
    import logging

    from pbkv.predict import store
    from pbkv.serve.learning import TrafficLearner
    from pbkv.trace import Trace, TraceMeta
    learner = TrafficLearner(variant="fused", horizon=2, every=1000)
    learner.save_to = tmp_path / "p"
    for i in range(3):
        learner.add(["plan", "code"], [f"task {i}", None])
    snapshot = Trace(TraceMeta(), [c for wf in learner.window for c in wf])
    monkeypatch.setattr(store, "_prune", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with caplog.at_level(logging.WARNING, logger="pbkv.predict"):
        learner._save(predictor, snapshot)
    assert learner.save_error is None and len(read_history(tmp_path / "p")) == 3
    assert "saved as v000001 (live), but tidying up after it failed" in caplog.text
    learner.add(["plan"], ["task 3"])
    save_predictor(predictor, tmp_path / "p", learner.unsaved_workflows(), learner.window.maxlen)
    assert [wf[0][1] for wf in read_history(tmp_path / "p")] == ["task 0", "task 1", "task 2", "task 3"]
