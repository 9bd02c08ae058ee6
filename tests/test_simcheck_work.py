"""`pbkv simcheck` compares like with like: the simulator has no load rule (it always loads a
host/disk prefix back), so `--load-rule recompute` with a host or disk tier is refused before any
replay, and a check on the work done (recomputed tokens, hit rates per tier) FAILs when the two
engines did different work, whatever the rank and speedup checks say."""

from __future__ import annotations

import pytest

import pbkv.bench.simcheck
from helpers import flat, invoke
from pbkv.bench.simcheck import verdict, work_check


@pytest.fixture
def no_replay(monkeypatch):
    def never(*_a, **_k):
        raise AssertionError("replayed although the load rule makes the engines do different work")
    monkeypatch.setattr(pbkv.bench.simcheck, "run_hf", never)
    monkeypatch.setattr(pbkv.bench.simcheck, "get_model", never)
    monkeypatch.setattr(pbkv.bench.simcheck, "calibrate", never)


def test_load_rule_recompute_with_host_and_disk_tiers_is_refused_before_replaying(tmp_path, no_replay):
    r = invoke("simcheck", "--model", "tiny", "--profile", "a6000-qwen3-32b", "--workflows", 2, "--concurrency", 1,
               "--policies", "lru", "--scale", 16, "--device-tokens", 300, "--host-tokens", 200,
               "--disk-tokens", 3000, "--load-rule", "recompute", "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    out = flat(r.output)
    assert "--load-rule recompute: the simulator always loads host/disk prefixes back" in out
    assert "host 200, disk 3,000 tokens" in out and "Traceback" not in r.output
    # without --profile: refused before calibrating
    r = invoke("simcheck", "--model", "tiny", "--workflows", 2, "--policies", "lru", "--host-tokens", 200,
               "--load-rule", "recompute", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "--load-rule recompute: the simulator always loads" in flat(r.output), r.output


def test_load_rule_recompute_with_default_tiers_is_refused_once_they_are_sized(tmp_path, no_replay):
    # --device-tokens alone: the real engine's host and disk default to host_ratio x and 8 x the device
    r = invoke("simcheck", "--model", "tiny", "--profile", "a6000-qwen3-32b", "--workflows", 2, "--concurrency", 1,
               "--policies", "lru", "--scale", 16, "--device-tokens", 300, "--load-rule", "recompute",
               "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert "--load-rule recompute: the simulator always loads" in flat(r.output)
    # without --profile too: refused before calibrating (it was refused only after it), with the
    # sizes the run would have had (calibrate's host_ratio 2)
    r = invoke("simcheck", "--model", "tiny", "--workflows", 2, "--policies", "lru", "--device-tokens", 300,
               "--load-rule", "recompute", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "(host 600, disk 2,400 tokens)" in flat(r.output), r.output


def test_load_rule_recompute_without_slower_tiers_is_the_same_work(tmp_path, monkeypatch):
    """No host or disk tier: nothing to load, the rule changes nothing; simcheck runs."""
    pbkv.bench.simcheck.check_load_rule("recompute", pbkv.bench.simcheck.Capacities(300, 0, 0))
    with pytest.raises(ValueError, match="host 0, disk 10 tokens"):
        pbkv.bench.simcheck.check_load_rule("recompute", pbkv.bench.simcheck.Capacities(300, 0, 10))
    for rule in ("auto", "load"):
        pbkv.bench.simcheck.check_load_rule(rule, pbkv.bench.simcheck.Capacities(300, 200, 3000))


def row(policy, real_lat, sim_lat, real_re, sim_re, real_host=0.0, sim_host=0.0):
    return {"policy": policy, "real_mean_workflow_latency_s": real_lat, "sim_mean_workflow_latency_s": sim_lat,
            "real_recomputed_tokens": real_re, "sim_recomputed_tokens": sim_re,
            "real_device_hit_rate": 0.4, "sim_device_hit_rate": 0.4, "real_host_hit_rate": real_host,
            "sim_host_hit_rate": sim_host, "real_disk_hit_rate": 0.0, "sim_disk_hit_rate": 0.0}


def test_different_work_fails_even_when_ranks_and_speedups_agree():
    # the repro's figures: the real engine recomputed what the simulator loaded from host (0% vs 17%
    # host hits, 2.5x the recomputed tokens); ranks and speedups agree, so every line said PASS
    rows = [row("lru", 2.0, 1.0, 2500, 1000, 0.0, 0.17), row("oracle", 1.6, 0.8, 2000, 800, 0.0, 0.17)]
    lines = verdict(rows)
    assert [x[:4] for x in lines[:3]] == ["PASS", "PASS", "PASS"], lines
    assert lines[-1].startswith("FAIL same work on both engines: lru host hits real 0.0% / simulated 17.0%; "
                                "lru recomputed tokens real 2,500 / simulated 1,000 (+150%)"), lines
    assert "oracle recomputed tokens real 2,000 / simulated 800" in lines[-1]


def test_the_same_work_passes_within_the_tolerances():
    rows = [row("lru", 2.0, 1.0, 9060, 9230, 0.10, 0.12), row("oracle", 1.6, 0.8, 6120, 6150)]
    assert work_check(rows) == ("PASS same work on both engines: recomputed tokens within 15%, "
                                "hit rates within 5 points")
    # 16% apart: more than the tolerance
    assert work_check([row("lru", 2.0, 1.0, 1160, 1000)]).startswith("FAIL same work on both engines: lru "
                                                                     "recomputed tokens real 1,160")
    # 6 points of host hits apart
    assert "lru host hits real 10.0% / simulated 16.0%" in work_check([row("lru", 2.0, 1.0, 100, 100, 0.10, 0.16)])


def test_rows_without_work_figures_get_no_work_line():
    assert work_check([{"policy": "lru", "real_mean_workflow_latency_s": 1.0, "sim_mean_workflow_latency_s": 1.0}]) is None
