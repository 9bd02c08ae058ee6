"""The connector's `kv_connector_extra_config` checks (`pbkv.integrations.vllm.config`), without vLLM:
every valid config gives the settings the connector used before; every invalid one is refused
with a ValueError naming `kv_connector_extra_config.<key>` and the value."""

import re
from pathlib import Path

import pytest

from pbkv.integrations.vllm import kv_transfer_config
from pbkv.integrations.vllm.config import KEYS, ConnectorConfig, parse_extra

DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def refused(extra) -> str:
    with pytest.raises(ValueError) as e:
        parse_extra(extra)
    return str(e.value)


def test_defaults_and_valid_values_are_kept_as_given(tmp_path):
    assert parse_extra(None) == parse_extra({}) == ConnectorConfig()
    assert ConnectorConfig().steer_gpu is True
    extra = kv_transfer_config("pbkv", predictor_dir=str(tmp_path), device_tokens=0, host_tokens=256,
                               disk_tokens=4096, disk_dir=str(tmp_path / "new" / "deeper"), steer_gpu=False,
                               stats_path=str(tmp_path / "stats.json"), shared_dir=str(tmp_path),
                               shared_bytes=1 << 20)["kv_connector_extra_config"]
    assert parse_extra(extra) == ConnectorConfig(**extra)
    assert parse_extra({"host_tokens": 10**30}).host_tokens == 10**30   # no upper bound: tiers are models


def test_null_means_not_given_except_for_steer_gpu():
    assert parse_extra({k: None for k in KEYS if k != "steer_gpu"}) == ConnectorConfig()
    assert "kv_connector_extra_config.steer_gpu=None" in refused({"steer_gpu": None})


@pytest.mark.parametrize("key, value", [
    ("steer_gpu", "false"), ("steer_gpu", 0), ("steer_gpu", 1),
    ("host_tokens", 12.7), ("host_tokens", True), ("host_tokens", "256"), ("host_tokens", [1]), ("host_tokens", -1),
    ("device_tokens", "abc"), ("device_tokens", -100), ("disk_tokens", -100), ("disk_tokens", 1.0),
    ("shared_bytes", 0), ("shared_bytes", 0.5), ("shared_bytes", -5), ("shared_bytes", "1GiB"),
    ("shared_bytes", False), ("policy", 5), ("policy", ""), ("policy", "  "),
    ("disk_dir", ""), ("disk_dir", 5), ("shared_dir", ["a"]), ("predictor_dir", ""), ("stats_path", ""),
    ("disk_dir", "a\0b"),
])
def test_a_bad_value_names_its_key_and_value(key, value):
    assert f"kv_connector_extra_config.{key}={value!r}" in refused({key: value})


@pytest.mark.parametrize("key", ["disk_dir", "shared_dir", "predictor_dir"])
def test_a_directory_key_refuses_a_file_or_a_path_under_one(tmp_path, key):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path in (afile, afile / "x"):
        message = refused({key: str(path)})
        assert f"kv_connector_extra_config.{key}={str(path)!r}" in message and str(afile) in message
    assert parse_extra({key: str(tmp_path / "not-yet" / "x")}) is not None   # created later


def test_stats_path_refuses_a_directory(tmp_path):
    assert "kv_connector_extra_config.stats_path" in refused({"stats_path": str(tmp_path)})


def test_stats_path_must_be_a_file_that_can_be_written(tmp_path):
    """Before: /proc/version passed (every write then only logged), and /dev/null passed (the
    stats' os.replace would put a regular file in its place, as root)."""
    assert "must name a regular file" in refused({"stats_path": "/dev/null"})
    message = refused({"stats_path": "/proc/version"})
    assert "kv_connector_extra_config.stats_path=" in message and "where files can be made ('/proc'" in message
    assert parse_extra({"stats_path": str(tmp_path / "stats.json")}).stats_path.endswith("stats.json")
    assert list(tmp_path.iterdir()) == []   # the trial file is gone


def test_stats_path_must_be_in_an_existing_directory(tmp_path):
    """It is first written when a request finishes: a missing directory must fail at start."""
    missing = str(tmp_path / "no-such-dir" / "stats.json")
    message = refused({"stats_path": missing})
    assert "kv_connector_extra_config.stats_path=" in message and "no-such-dir' is not one" in message
    (tmp_path / "file").write_text("")
    assert "is not one" in refused({"stats_path": str(tmp_path / "file" / "stats.json")})
    assert parse_extra({"stats_path": "stats.json"}).stats_path == "stats.json"   # the working directory


def test_unknown_keys_are_refused_with_the_known_keys_listed():
    message = refused({"host_token": 5, "polcy": "pbkv", "policy": "lru"})
    assert "kv_connector_extra_config.host_token (did you mean 'host_tokens'?)" in message
    assert "kv_connector_extra_config.polcy (did you mean 'policy'?)" in message
    assert "known keys: " + ", ".join(KEYS) in message


def test_every_problem_is_reported_at_once():
    message = refused({"steer_gpu": "false", "host_tokens": 1.5, "typo": 1})
    assert all(s in message for s in ("steer_gpu='false'", "host_tokens=1.5", "kv_connector_extra_config.typo"))


@pytest.mark.parametrize("extra", ["abc", [("policy", "lru")], 5])
def test_the_extra_config_must_be_an_object(extra):
    assert "kv_connector_extra_config must be a JSON object" in refused(extra)


def test_a_huge_int_in_an_error_does_not_break_the_message():
    assert "kv_connector_extra_config.shared_bytes=<a int too large to print>" in refused({"shared_bytes": -10**5000})


def test_the_documented_keys_are_the_checked_keys():
    table = DOCS.read_text().split("`kv_connector_extra_config` (all optional", 1)[1].split("\n\n", 2)[1]
    assert tuple(re.findall(r"^\| `(\w+)` \|", table, re.M)) == KEYS


@pytest.mark.parametrize("key", ["disk_dir", "shared_dir"])
def test_a_directory_that_cannot_be_made_is_refused_at_start(key, tmp_path):
    """/proc/x passed the start check; the worker then died with a bare OSError naming no key."""
    text = refused({key: "/proc/pbkv-no-such-dir"})
    assert f"kv_connector_extra_config.{key}='/proc/pbkv-no-such-dir'" in text and "can be made" in text
    assert parse_extra({key: str(tmp_path / "new" / "deeper")}) == ConnectorConfig(**{key: str(tmp_path / "new" / "deeper")})
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []   # the try leaves nothing


@pytest.mark.parametrize("extra, words", [
    ({"policy": "lru", "host_tokens": 0, "disk_tokens": 4096},
     ["kv_connector_extra_config.disk_tokens=4096", "kv_connector_extra_config.host_tokens=0"]),
    ({"policy": "pbkv"}, ["kv_connector_extra_config.policy='pbkv'", "kv_connector_extra_config.predictor_dir"]),
    ({"policy": "oracle"}, ["kv_connector_extra_config.policy='oracle'", "future"]),
    ({"policy": "pbkv-perfect"}, ["kv_connector_extra_config.policy='pbkv-perfect'", "future"]),
    ({"policy": "nope"}, ["kv_connector_extra_config.policy='nope'"]),
    ({"policy": "lru", "predictor_dir": "/tmp"}, ["kv_connector_extra_config.predictor_dir='/tmp'",
                                                  "reads no trained predictor (policies that do: pbkv, "])])
def test_start_errors_name_the_extra_config_keys(extra, words):
    """They spoke of `pbkv bench` flags (--disk-tokens, --train FILE, PolicyContext.future)."""
    from pbkv.integrations.vllm.config import connector_policy
    with pytest.raises(ValueError) as e:
        connector_policy(parse_extra(extra))
    text = str(e.value)
    assert all(w in text for w in words), text
    assert " --" not in text and "PolicyContext" not in text


def test_the_connector_runs_its_start_check(tmp_path):
    """PBKVConnector._make_shadow goes through connector_policy (the connector imports vLLM)."""
    from pbkv.integrations.vllm.config import connector_policy
    assert connector_policy(parse_extra({})) == "lru"
    assert connector_policy(parse_extra({"policy": "kvflow", "host_tokens": 0})) == "kvflow"
    src = (Path(__file__).resolve().parents[1] / "src/pbkv/integrations/vllm/connector.py").read_text()
    assert "policy = connector_policy(config)" in src


def test_agent_graph_reaches_kvflow_in_the_shadow():
    """kvflow inside the connector got no agent graph: it ranked as LRU while labelled kvflow."""
    from pbkv.cache import Capacities
    from pbkv.integrations.vllm.shadow import Shadow
    graph = {"START": ["plan"], "plan": ["act"], "act": ["plan", "END"]}
    cfg = parse_extra({"policy": "kvflow", "agent_graph": graph, "static_sequence": ["plan", "act"]})
    assert cfg.agent_graph == graph and cfg.static_sequence == ["plan", "act"]
    shadow = Shadow(16, Capacities(64, 64, 0), "kvflow", agent_graph=cfg.agent_graph,
                    static_sequence=cfg.static_sequence)
    assert shadow.policy.graph.edges
    assert not Shadow(16, Capacities(64, 64, 0), "kvflow").policy.graph.edges
    for bad in ({"plan": "act"}, ["plan"], {"plan": [1]}, {"": ["x"]}):
        assert "kv_connector_extra_config.agent_graph=" in refused({"agent_graph": bad})
    assert "kv_connector_extra_config.static_sequence=" in refused({"static_sequence": "plan"})


@pytest.mark.parametrize("extra, words", [
    ({"policy": "no-such-policy", "host_tokens": -1},
     ["kv_connector_extra_config.policy='no-such-policy'", "kv_connector_extra_config.host_tokens=-1"]),
    ({"policy": "oracle", "host_tokens": 0, "disk_tokens": 64, "shared_bytes": 0},
     ["kv_connector_extra_config.policy='oracle'", "kv_connector_extra_config.disk_tokens=64",
      "kv_connector_extra_config.shared_bytes=0"]),
    ({"policy": "pbkv", "device_tokens": 1.5}, ["kv_connector_extra_config.policy='pbkv'",
                                                "kv_connector_extra_config.device_tokens=1.5"]),
    # a null key is unset, not bad: the policy's checks still run (they were skipped)
    ({"policy": "nosuch", "predictor_dir": None}, ["kv_connector_extra_config.policy='nosuch'"]),
    ({"policy": "pbkv", "predictor_dir": None}, ["kv_connector_extra_config.policy='pbkv'"])])
def test_one_error_names_every_bad_key_the_policy_included(extra, words):
    """The policy was checked only at the scheduler's start, after the other keys had passed: a
    config with a bad policy and another bad key needed two starts to see both."""
    text = refused(extra)
    assert all(w in text for w in words), text


def test_a_refused_key_is_not_named_again_by_the_policy_checks():
    text = refused({"policy": "pbkv", "predictor_dir": 5, "host_tokens": 0, "disk_tokens": -1})
    assert "needs a trained" not in text and "with kv_connector_extra_config.host_tokens=0" not in text, text
    assert "kv_connector_extra_config.predictor_dir=5" in text and "disk_tokens=-1" in text, text
