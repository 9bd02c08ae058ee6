"""Predictor folders a user or a tamperer prepared: a save never touches what is not a
predictor's, what would make a save fail after the work is refused before it, and every damaged
file of a saved predictor is a one-line error naming the file, the field and the value."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
from types import SimpleNamespace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbkv.cli import app
from pbkv.predict import PredictorLoadError, load_predictor, save_predictor, train_predictor
from pbkv.predict import store
from pbkv.predict.history import FILE, read_history
from pbkv.predict.model import ModelConfig, PredictorNet
from pbkv.predict.store import check_target, live_dir
from pbkv.serve.learning import build_policy, finish_learning
from pbkv.trace import Call, Trace, TraceMeta

TRACE = Path(__file__).parent / "data" / "chatdev-mini.jsonl"
FLOWS = [[("plan", "task: alpha"), ("review", None)]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    calls = [Call(f"w{w}", s, a, 16, 1, [w * 10 + s], done=s == 2) for w in range(6)
             for s, a in enumerate(["plan", "code", "review"])]
    p = train_predictor(Trace(TraceMeta(), calls), epochs=1, seed=0)
    return save_predictor(p, tmp_path_factory.mktemp("p") / "m", history=FLOWS)


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    """A fresh copy of the saved predictor (one version, v000001)."""
    return Path(shutil.copytree(saved, tmp_path / "m"))


def flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())   # typer's error box, unwrapped


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---- 1. a save touches only a predictor's files

def leveldb_like(path: Path) -> Path:
    path.mkdir()
    (path / "CURRENT").write_text("MANIFEST-000001\n")
    (path / "MANIFEST-000001").write_text("data\n")
    (path / "config.json").write_text('{"my": "settings"}')
    (path / "v0000001").mkdir()
    (path / "v0000001" / "a.txt").write_text("precious")
    return path


def test_a_folder_with_a_foreign_CURRENT_is_refused_and_left_untouched(saved, tmp_path):
    user = leveldb_like(tmp_path / "db")
    before = files(user)
    with pytest.raises(ValueError, match=r"db: holds other files \(CURRENT, MANIFEST-000001, config.json, "
                                         r"v0000001\) and no saved predictor"):
        check_target(user)
    with pytest.raises(ValueError, match="holds other files"):
        save_predictor(load_predictor(saved), user)
    r = CliRunner().invoke(app, ["train", "--trace", str(TRACE), "-o", str(user), "--epochs", "1"])
    assert r.exit_code == 2 and "holds other files" in flat(r.output), r.output
    assert files(user) == before


def test_CURRENT_naming_a_folder_without_a_predictor_is_no_saved_predictor(tmp_path):
    user = tmp_path / "u"
    (user / "v000001").mkdir(parents=True)
    (user / "v000001" / "notes.txt").write_text("mine")
    (user / "CURRENT").write_text("v000001\n")
    with pytest.raises(ValueError, match=r"holds other files \(CURRENT, v000001\)"):
        check_target(user)


def test_a_save_never_removes_a_users_folder_named_like_a_version(folder, saved):
    p = load_predictor(saved)
    for name in ("v000000", "v000005"):
        (folder / name).mkdir()
        (folder / name / "a.txt").write_text("precious")
    for _ in range(3):
        save_predictor(p, folder)
    assert (folder / "v000000" / "a.txt").read_text() == "precious"
    assert (folder / "v000005" / "a.txt").read_text() == "precious"
    assert (folder / "CURRENT").read_text() == "v000008\n"            # numbered above the user's v000005
    assert sorted(e.name for e in folder.iterdir() if e.name.startswith("v")) == \
        ["v000000", "v000005", "v000007", "v000008"]                  # the live one and the one before


def test_a_users_config_json_beside_a_versioned_predictor_is_kept(folder, saved):
    (folder / "config.json").write_text('{"my": "settings"}')
    save_predictor(load_predictor(saved), folder)
    assert (folder / "config.json").read_text() == '{"my": "settings"}'


# ---- 3. what would fail a save after the work is refused before it

def test_a_lock_that_is_a_folder_or_a_fifo_is_refused_before_any_work(folder, tmp_path):
    (folder / ".lock").unlink()
    (folder / ".lock").mkdir()
    with pytest.raises(ValueError, match=r"m/\.lock: is a folder, not a lock file"):
        check_target(folder)
    r = CliRunner().invoke(app, ["train", "--trace", str(TRACE), "-o", str(folder), "--epochs", "1"])
    assert r.exit_code == 2 and ".lock: is a folder" in flat(r.output), r.output
    assert "training" not in r.output
    fifo = tmp_path / "f"
    fifo.mkdir()
    os.mkfifo(fifo / ".lock")
    with pytest.raises(ValueError, match=r"f/\.lock: is not a regular file \(a FIFO"):
        check_target(fifo)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")
def test_an_unwritable_lock_is_refused_before_any_work(folder):
    (folder / ".lock").chmod(0o444)
    with pytest.raises(ValueError, match=r"\.lock: cannot be opened for writing"):
        check_target(folder)


def test_taking_the_lock_never_waits_for_a_fifo_reader(folder, saved, monkeypatch):
    """Past `check_target` (the FIFO appeared after it), the save fails at once instead of hanging."""
    (folder / ".lock").unlink()
    os.mkfifo(folder / ".lock")
    monkeypatch.setattr(store, "check_target", lambda path: None)
    errors = []

    def save():
        try:
            store.publish(folder, lambda f: None)
        except (OSError, ValueError) as e:
            errors.append(str(e))
    t = threading.Thread(target=save, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():   # blocked in open(): a reader releases it, so the thread ends
        os.close(os.open(folder / ".lock", os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("the save blocked opening a FIFO .lock")
    assert errors and ".lock: is not a regular file" in errors[0]


def test_a_file_with_a_version_name_is_skipped_not_fatal(folder, saved):
    (folder / "v000002").write_text("hi")
    save_predictor(load_predictor(saved), folder)
    assert (folder / "CURRENT").read_text() == "v000003\n" and (folder / "v000002").read_text() == "hi"
    assert load_predictor(folder).agents == load_predictor(saved).agents


def test_a_failed_save_names_the_version_not_its_temporary_folder(folder):
    def write(tmp: Path):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))
    with pytest.raises(OSError) as e:
        store.publish(folder, write)
    assert str(e.value) == f"{folder / 'v000002'}: cannot save (No space left on device)"
    assert sorted(e.name for e in folder.iterdir()) == [".lock", "CURRENT", "v000001"]


def test_serve_refuses_at_start_a_predictor_folder_it_could_not_save_to(folder):
    (folder / ".lock").unlink()
    (folder / ".lock").mkdir()
    with pytest.raises(ValueError, match=r"\.lock: is a folder"):
        build_policy("pbkv", 16, predictor_dir=folder, online=True)


def test_a_save_failing_at_shutdown_is_one_error_line_and_recorded(folder, caplog):
    setup = build_policy("pbkv", 16, predictor_dir=folder, online=True)
    (folder / ".lock").unlink()
    (folder / ".lock").mkdir()                     # broken after start-up: found by the save itself
    with caplog.at_level(logging.ERROR, logger="pbkv.serve"):
        assert finish_learning(setup) is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert f"cannot save the predictor to {folder}: {folder}/.lock: is a folder" in errors[0].getMessage()
    assert setup.save_error.startswith(f"{folder}/.lock: is a folder")   # kept for `pbkv serve`'s exit status


def test_pbkv_serve_exits_1_after_a_failed_shutdown_save(monkeypatch):
    import pbkv.serve
    failed = SimpleNamespace(setup=SimpleNamespace(save_error="x"))
    monkeypatch.setattr(pbkv.serve, "run", lambda cfg, log_level: failed)
    r = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert r.exit_code == 1, r.output
    monkeypatch.setattr(pbkv.serve, "run", lambda cfg, log_level: None)
    assert CliRunner().invoke(app, ["serve", "--port", "0"]).exit_code == 0


def test_pbkv_serve_hands_on_absolute_paths(monkeypatch, tmp_path):
    """With --replicas the engines run in Ray workers started elsewhere: a relative --predictor,
    --record or model folder would be read and written there."""
    import pbkv.serve
    seen = {}
    monkeypatch.setattr(pbkv.serve, "run", lambda cfg, log_level: seen.update(cfg=cfg))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    r = CliRunner().invoke(app, ["serve", "--port", "0", "--model", "models/m", "--predictor", "pred",
                                 "--record", "rec.jsonl"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (cfg.model, cfg.predictor_dir, cfg.record) == (str(tmp_path / "models" / "m"), str(tmp_path / "pred"),
                                                          str(tmp_path / "rec.jsonl"))
    (tmp_path / "tiny").mkdir()   # a folder of that name here: the built-in name still wins, as in load_model
    CliRunner().invoke(app, ["serve", "--port", "0", "--model", "tiny", "--max-agents", "3"])
    assert seen["cfg"].model == "tiny" and seen["cfg"].max_agents == 3   # a built-in name stays a name


# ---- 2. workflows.json

def write_history_text(folder: Path, text: str) -> None:
    (live_dir(folder) / FILE).write_text(text)


@pytest.mark.parametrize("rows, message", [
    ([[["plan", "task: x \ud800 y"]]], r"workflows.0: a string holds a lone surrogate .*got 'task: x \\ud800 y'"),
    ([[["plan", None]], [["\udfff", None]]], r"workflows.1: a string holds a lone surrogate"),
], ids=["context", "agent"])
def test_a_lone_surrogate_in_the_history_is_a_start_up_error(folder, rows, message):
    write_history_text(folder, json.dumps({"format": "pbkv-workflows", "workflows": rows}))
    with pytest.raises(ValueError, match=f"workflows.json: {message}"):
        read_history(folder)
    with pytest.raises(ValueError, match=message):
        build_policy("pbkv", 16, predictor_dir=folder, online=True)


def test_read_only_serving_never_reads_the_history(folder):
    """Before: `--no-online`, which learns nothing from it, refused to start on a damaged
    workflows.json; a learning server still refuses it (its saves would drop that traffic)."""
    write_history_text(folder, '{"format": "pbkv-workflows", "workflows": [[]]}')
    setup = build_policy("pbkv", 16, predictor_dir=folder, online=False)
    assert setup.loaded and setup.history == [] and setup.learner is None
    with pytest.raises(ValueError, match=r"workflows.json: workflows.0: expected a non-empty list"):
        build_policy("pbkv", 16, predictor_dir=folder, online=True)


def test_a_deeply_nested_history_is_a_start_up_error(folder):
    write_history_text(folder, '{"format": "pbkv-workflows", "workflows": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"workflows.json: not JSON \(nested too deeply\)"):
        read_history(folder)


def test_a_history_that_is_a_folder_is_an_error_not_no_history(folder):
    (live_dir(folder) / FILE).unlink()
    (live_dir(folder) / FILE).mkdir()
    with pytest.raises(ValueError, match=r"v000001/workflows.json: not a file"):
        read_history(folder)


# ---- 4. config.json and markov.json

def edit_config(edit):
    def change(folder: Path) -> None:
        path = live_dir(folder) / "config.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return change


def set_model(key, value, features=False):
    def edit(c):
        (c["model"]["features"] if features else c["model"])[key] = value
    return edit_config(edit)


def replace_file(name: str, text: str | None):
    """Replace the live version's `name` with `text`, or with a folder (None)."""
    def change(folder: Path) -> None:
        path = live_dir(folder) / name
        path.unlink()
        path.mkdir() if text is None else path.write_text(text)
    return change


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("change, message", [
    (replace_file("config.json", "[]"), r"\(expected a JSON object, got \[\]\)"),
    (replace_file("config.json", '"x"'), r"\(expected a JSON object, got 'x'\)"),
    (edit_config(lambda c: c.update(agents="pcr")), r"field 'agents': expected a list of agent names .*got 'pcr'"),
    (edit_config(lambda c: c.update(agents=[c["agents"][0]] * len(c["agents"]))),
     r"field 'agents': agent '\w+' is listed twice"),
    (edit_config(lambda c: c.update(agents=list(range(len(c["agents"]))))),
     r"field 'agents': expected a list of agent names \(strings\), got \[0, 1"),
    (set_model("heads", 0), r"field 'model.heads': expected an integer from 1 to 4,096, got 0"),
    (set_model("features", "x"), r"field 'model.features': expected an object, got 'x'"),
    (set_model("buckets", -1, features=True), r"field 'model.features.buckets': expected an integer .*got -1"),
    (set_model("thermometer", 2, features=True), r"field 'model.features.thermometer': expected true or false"),
    (set_model("colour", 2, features=True), r"field 'model.features': unknown key 'colour'"),
    (set_model("hidden", 10 ** 12), r"field 'model.hidden': expected an integer from 1 to 65,536, got 1000000000000"),
    (set_model("hidden", 60_000), r"field 'model': the network would hold 3,\d{3},\d{3},\d{3} numbers, more than"),
    (set_model("dim", "32"), r"field 'model.dim': expected an integer from 1 to 4,096, got '32'"),
    (set_model("dropout", 5), r"field 'model.dropout': expected a number from 0 to 1, got 5"),
    (set_model("horizon", True), r"field 'model.horizon': expected an integer from 1 to 1,024, got True"),
    (edit_config(lambda c: c.pop("model")), r"field 'model': expected an object, got None"),
    (edit_config(lambda c: c.update(info=[1, 2])), r"field 'info': expected an object, got \[1, 2\]"),
    (edit_config(lambda c: c["info"].update(workflows="many")),
     r"field 'info.workflows': expected an integer >= 0, got 'many'"),
    (edit_config(lambda c: c["info"].update(workflows=True)), r"field 'info.workflows': expected an integer >= 0"),
], ids=["config-list", "config-string", "agents-string", "agents-repeated", "agents-ints", "heads-0",
        "features-string", "buckets-negative", "thermometer-int", "features-unknown-key", "hidden-huge",
        "hidden-too-big-in-all", "dim-string", "dropout-5", "horizon-true", "model-missing", "info-list",
        "info-workflows-string", "info-workflows-bool"])
def test_a_tampered_config_is_refused_naming_file_field_value(folder, change, message):
    change(folder)
    with pytest.raises(PredictorLoadError, match=f"v000001/config.json: invalid config .*{message}"):
        load_predictor(folder)


@pytest.mark.parametrize("change, message", [
    (replace_file("markov.json", "[]"), r"markov.json: not a valid Markov model \(expected a JSON object, got \[\]\)"),
    (replace_file("markov.json", None), r"v000001/markov.json: not a file"),
    (replace_file("markov.json", DEEP), r"markov.json: not a valid Markov model \(JSON nested too deeply\)"),
    (replace_file("config.json", DEEP), r"config.json: invalid config \(JSON nested too deeply\)"),
], ids=["markov-list", "markov-folder", "markov-deep", "config-deep"])
def test_a_tampered_markov_or_deep_json_is_refused_naming_the_file(folder, change, message):
    change(folder)
    with pytest.raises(PredictorLoadError, match=message):
        load_predictor(folder)


def test_markov_agents_are_checked_like_the_configs(folder):
    path = live_dir(folder) / "markov.json"
    data = json.loads(path.read_text())
    data["agents"] = "".join(data["agents"])[:len(data["agents"])]
    path.write_text(json.dumps(data))
    with pytest.raises(PredictorLoadError, match=r"markov.json: not a valid Markov model \(field 'agents': "
                                                 r"expected a list of agent names"):
        load_predictor(folder)


def test_predict_eval_reports_a_tampered_config_in_one_line(folder):
    set_model("heads", 0)(folder)
    r = CliRunner().invoke(app, ["predict-eval", "--predictor", str(folder), "--trace", str(TRACE)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "config.json: invalid config (field 'model.heads': expected an integer" in flat(r.output)


@pytest.mark.parametrize("variant", ["fused", "history", "context"])
@pytest.mark.parametrize("context_dim, n_agents, layers", [(0, 0, 2), (8, 5, 0), (0, 7, 3)])
def test_the_size_check_counts_exactly_what_the_network_holds(variant, context_dim, n_agents, layers):
    cfg = ModelConfig(n_agents=n_agents, variant=variant, context_dim=context_dim, graph_layers=layers, horizon=2,
                      dim=16, heads=2, hidden=24, features={"window": 8, "buckets": 100, "max_count": 5})
    net = PredictorNet(cfg)
    assert cfg.numbers() == sum(t.numel() for t in (*net.parameters(), *net.buffers()))


def test_the_saved_predictor_loads_unchanged(folder, saved):
    p, q = load_predictor(folder), load_predictor(saved)
    assert p.agents == q.agents and p.cfg == q.cfg and p.info == q.info and read_history(folder) == FLOWS
