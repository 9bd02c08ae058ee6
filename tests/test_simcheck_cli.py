"""`pbkv simcheck`'s command line: a bad --policies or --workflows is refused before calibrating or
replaying anything (exit 2, one error line), and the title says what was replayed."""

from __future__ import annotations

import pytest

import pbkv.bench.simcheck
from helpers import flat, invoke



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


TRACE = "tests/data/chatdev-mini.jsonl"  # 3 workflows


def fake_rows(policies):
    row = {"device_tokens": 100, "host_tokens": 200, "disk_tokens": 800}
    for key, _, _ in pbkv.bench.simcheck.COMPARED:
        row[f"real_{key}"] = row[f"sim_{key}"] = 1.0
    return [{**row, "policy": p} for p in policies]


def test_simcheck_refuses_workflows_with_a_trace(no_work):
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", TRACE, "--workflows", 1,
               "--policies", "lru", "--concurrency", 1)
    assert r.exit_code == 2, r.output
    assert "--workflows applies to generated workloads" in flat(r.output) and "3 workflows" in flat(r.output)


def test_simcheck_title_counts_the_workflows_of_the_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", lambda source, policies, *a, **k: fake_rows(policies))
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", TRACE, "--policies", "lru",
               "--concurrency", 1, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "chatdev-mini.jsonl x3," in r.output and " x8," not in r.output


def test_simcheck_title_counts_the_generated_workflows(tmp_path, monkeypatch):
    monkeypatch.setattr(pbkv.bench.simcheck, "simcheck", lambda source, policies, *a, **k: fake_rows(policies))
    r = invoke("simcheck", "--profile", "a6000-qwen3-32b", "--workload", "hover", "--workflows", 2,
               "--policies", "lru", "--concurrency", 1, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "hover x2," in r.output


# ---------------------------------------------------------------- the verdict's rank test

def verdict_row(policy, real_lat, sim_lat, real_re=100, sim_re=100):
    return {"policy": policy, "real_mean_workflow_latency_s": real_lat, "sim_mean_workflow_latency_s": sim_lat,
            "real_recomputed_tokens": real_re, "sim_recomputed_tokens": sim_re}


@pytest.mark.parametrize("real_lru, real_kvflow", [(1.150, 1.162), (1.162, 1.150), (1.154, 1.154)])
def test_a_tie_within_the_noise_is_no_rank_claim_whatever_the_names_or_order(real_lru, real_kvflow):
    """Identical policies (the simulator gives both the same figures) must PASS whichever way the
    real engine's ~1% timing noise falls, and whatever order the rows come in."""
    rows = [verdict_row("lru", real_lru, 1.15395), verdict_row("kvflow", real_kvflow, 1.15395)]
    for order in (rows, rows[::-1]):
        lines = pbkv.bench.simcheck.verdict(order)
        assert lines[0].startswith("PASS rank by latency"), lines
        assert lines[1].startswith("PASS rank by recomputed tokens"), lines
        assert "simulated kvflow ~ lru" in lines[0] and " ~ " in lines[0].split(";")[0]
        assert lines == pbkv.bench.simcheck.verdict(rows)  # the rows' order changes nothing


def test_a_rank_inversion_beyond_the_tie_fails_and_names_the_pair():
    lines = pbkv.bench.simcheck.verdict([verdict_row("lru", 10.0, 5.0), verdict_row("pbkv", 11.0, 4.0),
                                         verdict_row("kvflow", 10.05, 5.02)])
    assert lines[0].startswith("FAIL rank by latency"), lines
    assert "real lru ~ kvflow < pbkv; simulated pbkv < lru ~ kvflow" in lines[0]
    assert "disagree: kvflow vs pbkv, lru vs pbkv" in lines[0]


def test_a_tie_on_one_engine_only_is_no_disagreement():
    lines = pbkv.bench.simcheck.verdict([verdict_row("lru", 10.0, 5.0, 100, 100),
                                         verdict_row("pbkv", 10.1, 4.0, 100, 60)])
    assert lines[0].startswith("PASS rank by latency") and lines[1].startswith("PASS rank by recomputed")


def test_simcheck_refuses_a_bad_profile_before_any_work(tmp_path, no_work):
    import json
    from pbkv.engine.profiles import load_profile
    data = json.loads(load_profile("a6000-qwen3-32b").model_dump_json())
    data["step_overhead_msec"] = data.pop("step_overhead_ms")
    (tmp_path / "typo.json").write_text(json.dumps(data))
    r = invoke("simcheck", "--profile", tmp_path / "typo.json", "--policies", "lru", "--workflows", 2,
               "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert "typo.json: field 'step_overhead_msec': unknown field" in flat(r.output)


# ---------------------------------------------------------------- defaults that make policies differ

def test_identical_work_gets_no_speedup_check_whatever_the_real_noise():
    """Policies with the same simulated hits and recomputed tokens did the same work: the
    simulator says 1.000x by construction, the real engine's 1.58x is timing noise (seen on a
    loaded machine). No FAIL on it: one line says the speedups were not compared."""
    def row(policy, real_lat):
        return {**verdict_row(policy, real_lat, 1.66), "sim_device_hit_rate": 0.712, "sim_host_hit_rate": 0.0,
                "sim_disk_hit_rate": 0.0}
    lines = pbkv.bench.simcheck.verdict([row("lru", 2.83), row("kvflow", 2.58), row("pbkv", 1.79),
                                         row("oracle", 1.76)])
    assert not any(line.startswith("FAIL") for line in lines), lines
    assert lines[2].startswith("-- speedups over lru not compared: all policies did identical work"), lines
    assert len(lines) == 4 and lines[3].startswith("PASS same work on both engines"), lines
    # one policy with the same work as lru: only its line is skipped
    other = {**row("pbkv", 2.6), "sim_recomputed_tokens": 60, "sim_mean_workflow_latency_s": 1.5}
    lines = pbkv.bench.simcheck.verdict([row("lru", 2.83), row("kvflow", 2.58), other])
    assert lines[2].startswith("-- kvflow speedup over lru not compared: the same work as lru"), lines
    assert lines[3].startswith("PASS pbkv speedup over lru"), lines


def test_simcheck_default_memory_makes_the_policies_differ():
    """Without --device-tokens the device holds 0.3 of the scaled workload's distinct prompt tokens
    (at least its longest call), no host or disk: LRU and the oracle recompute different amounts.
    Given capacities are kept as they are."""
    from pbkv.bench.hf_run import HFConfig, scale_workload
    from pbkv.bench.regimes import distinct_prompt_tokens, largest_call
    from pbkv.bench.run import RunConfig, simulate
    from pbkv.bench.sweep import load_workload, source_from_arg
    from pbkv.cache import CacheConfig
    from pbkv.engine.profiles import load_profile
    scaled = scale_workload(load_workload(source_from_arg("hover", 8, 0)), HFConfig(scale=8.0))
    cache = pbkv.bench.simcheck.pressured(CacheConfig(), scaled)
    assert cache.device_tokens == max(largest_call(scaled), int(0.3 * distinct_prompt_tokens(scaled)))
    assert (cache.host_tokens, cache.disk_tokens) == (0, 0)
    recomputed = {p: simulate(scaled, RunConfig(policy=p, concurrency=4, profile=load_profile("a6000-qwen3-32b"),
                                                cache=cache))["recomputed_tokens"] for p in ("lru", "oracle")}
    assert recomputed["oracle"] < 0.9 * recomputed["lru"], recomputed
    given = CacheConfig(5000, None, None)
    assert pbkv.bench.simcheck.pressured(given, scaled) is given
