"""`pbkv bench --samples N`: each cell run at slightly larger memories and averaged."""

import functools
import io
import json

import pytest

from pbkv.bench import samples
from rich.console import Console

from pbkv.bench.main import BenchArgs, check
from pbkv.bench.report import print_tables
from pbkv.bench.run import RunConfig
from pbkv.bench.sweep import Source, SweepConfig, cell_of, finish_records, run_sweep, sweep_jobs
from pbkv.bench.verdict import verdicts
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile


def test_sample_zero_is_the_nominal_run_and_later_ones_scale_every_tier():
    run = RunConfig("lru", 4, load_profile("a6000-qwen3-32b"), CacheConfig(1000, 2000, 0))
    assert samples.scaled(run, 0) is run
    caps = samples.scaled(run, 2).capacities()
    assert (caps.device, caps.host, caps.disk) == (1010, 2020, 0)
    # capacities left to the profile are resolved first, then scaled
    prof = RunConfig("lru", 4, load_profile("a6000-qwen3-32b"))
    assert samples.scaled(prof, 1).capacities().device == round(prof.capacities().device * 1.005)
    # sizes are rounded (6000 x 1.005 is 6029.99... in floats), the shared tier's too
    assert samples.scaled(RunConfig("lru", 4, load_profile("a6000-qwen3-32b"), CacheConfig(6000)), 1) \
        .capacities().device == 6030
    assert [samples.tokens(20000, i) for i in range(3)] == [20000, 20100, 20200]


def test_samples_scale_the_shared_tier_of_several_instances(monkeypatch):
    from pbkv.bench import cluster_run
    seen = []
    real = cluster_run.simulate_cluster

    def spy(*args, **kwargs):
        seen.append(kwargs["shared_tokens"])
        return real(*args, **kwargs)
    monkeypatch.setattr(cluster_run, "simulate_cluster", spy)
    cfg = SweepConfig(sources=[Source("hover", spec="hover", workflows=6, seed=0)], policies=["lru"], concurrency=[2],
                      cache=CacheConfig(device_tokens=20_000), jobs=1, samples=3, instances=[2],
                      routers=["round-robin"], shared_tokens=20_000)
    run_sweep(cfg)
    assert sorted(seen) == [20000, 20100, 20200]


def rec(policy, sample, latency, hits=0.5, evictions=10):
    return {"workload": "w", "policy": policy, "concurrency": 4, "pressure": 0.05, "tiers": "device",
            "mean_workflow_latency_s": latency, "mean_ttft_s": 1.0, "device_hit_rate": hits,
            "evictions": evictions, "device_tokens": 1000 + 5 * sample, samples.SAMPLE_KEY: sample}


TABLE = {"workflows": 2, "p99_workflow_latency_s": 1.0, "host_hit_rate": 0.0, "disk_hit_rate": 0.0,
         "recomputed_tokens": 0, "bytes_loaded": 0, "host_tokens": 0, "disk_tokens": 0}


def test_average_means_each_figure_keeps_nominal_capacities_and_gives_the_speedup_range():
    raw = [rec("lru", 0, 10.0), rec("lru", 1, 12.0, evictions=11), rec("pbkv", 0, 8.0, hits=0.6),
           rec("pbkv", 1, 12.0, hits=0.7, evictions=13)]
    lru, pbkv = finish_records(samples.average(raw, cell_of))
    assert lru["samples"] == pbkv["samples"] == 2
    assert lru["mean_workflow_latency_s"] == 11.0 and lru["evictions"] == 10   # round(10.5): ints stay ints
    assert pbkv["device_hit_rate"] == pytest.approx(0.65) and pbkv["evictions"] == 12
    assert pbkv["device_tokens"] == 1000                      # the nominal (sample 0) capacity
    assert pbkv["speedup_vs_lru"] == 1.1                      # ratio of mean latencies: 11 / 10
    assert (pbkv["speedup_vs_lru_min"], pbkv["speedup_vs_lru_max"]) == (1.0, 1.25)   # 12/12, 10/8
    assert samples.SAMPLE_KEY not in pbkv and "speedup_vs_lru_min" not in lru
    assert "(1.00-1.25 over 2 samples)" in verdicts([lru, pbkv, {**pbkv, "policy": "oracle"}])[0]
    console = Console(record=True, width=300)
    print_tables([{**r, **TABLE} for r in (lru, pbkv)], console)
    text = console.export_text()
    assert "means of 2 samples" in " ".join(text.split()) and "1.10 │ 1.00-1.25" in text   # the title wraps


def test_samples_run_every_cell_n_times_and_one_sample_is_the_plain_run():
    src = Source("hover", spec="hover", workflows=6, seed=1)
    base = dict(sources=[src], policies=["lru", "arc"], concurrency=[3], pressures=[0.05], tiers=["device"], jobs=1)
    assert [(j[1], j[6]) for j in sweep_jobs(SweepConfig(**base, samples=2))] == [
        ("lru", 0), ("lru", 1), ("arc", 0), ("arc", 1)]
    plain = run_sweep(SweepConfig(**base))
    assert json.dumps(run_sweep(SweepConfig(**base, samples=1))) == json.dumps(plain)
    twice = run_sweep(SweepConfig(**base, samples=2))
    assert [(r["policy"], r["samples"]) for r in twice] == [("lru", 2), ("arc", 2)]
    assert twice[0]["device_tokens"] == plain[0]["device_tokens"]
    assert twice[1]["speedup_vs_lru_min"] <= twice[1]["speedup_vs_lru_max"]


def test_samples_are_checked():
    with pytest.raises(ValueError, match="--samples must be >= 1, got 0"):
        check(BenchArgs(sources=[], policies=["lru"], concurrency=[4], samples=0))
    with pytest.raises(ValueError, match="--samples averages simulated runs .*not --engine hf"):
        check(BenchArgs(sources=[], policies=["lru"], concurrency=[4], samples=2, engine="hf"))


def test_both_commands_take_samples_and_pass_them_to_the_sweep(monkeypatch, tmp_path):
    import pbkv.bench.main
    from typer.testing import CliRunner

    from pbkv.cli import app
    seen = []
    monkeypatch.setattr(pbkv.bench.main, "run", lambda args, console: seen.append(args.samples))
    args = ["--workload", "swe", "--workflows", "2", "--concurrency", "2", "--samples", "3", "--out", str(tmp_path)]
    for command in ("bench", "ablate"):
        r = CliRunner().invoke(app, [command, *args])
        assert r.exit_code == 0, r.output
    assert seen == [3, 3]


def test_behind_routers_each_record_gets_the_best_other_routers_range_per_sample():
    def run(router, sample, latency):
        return {"workload": "w", "policy": "lru", "concurrency": 4, "pressure": None, "tiers": None, "instances": 2,
                "router": router, "mean_workflow_latency_s": latency, "mean_ttft_s": 1.0, "device_hit_rate": 0.5,
                samples.SAMPLE_KEY: sample}
    raw = [run("prefix", 0, 10.0), run("prefix", 1, 12.0), run("pbkv", 0, 9.0), run("pbkv", 1, 12.5),
           run("sticky", 0, 11.0), run("sticky", 1, 11.0)]
    got = {r["router"]: r for r in finish_records(samples.average(raw, cell_of))}
    # pbkv: sample 0 best other 10 / 9, sample 1 best other 11 / 12.5
    close = functools.partial(pytest.approx, rel=1e-5)          # records are rounded to 6 digits
    assert (got["pbkv"]["vs_best_router_min"], got["pbkv"]["vs_best_router_max"]) == close((0.88, 10 / 9))
    assert (got["sticky"]["vs_best_router_min"], got["sticky"]["vs_best_router_max"]) == close((9 / 11, 12 / 11))
    # the console is not a terminal and narrower than the table (a CI log at the CLI's 110 columns):
    # before, the figures came out cut ("1.023 (0.880-1.…"); now the table keeps its natural width
    console = Console(record=True, width=110, file=io.StringIO())
    print_tables([{**r, **TABLE, "link": "pcie4", "makespan_s": 60.0, "bytes_moved_between_instances": 0,
                   "workflow_moves": 0, "device_tokens": 1000} for r in got.values()], console)
    text = console.export_text()
    assert "1.023 (0.880-1.111)" in text and "…" not in text   # pbkv's x best: 11 / 10.75, and its range
    assert console.width == 110


def test_ablate_takes_benchs_memory_regimes_by_default_and_when_given(monkeypatch, tmp_path):
    """`pbkv ablate` at its defaults ran on the profile's whole memory (nothing evicted: every
    policy identical); it now sizes memory as `pbkv bench` does (--pressure auto, --tiers auto)."""
    import pbkv.bench.main
    from typer.testing import CliRunner

    from pbkv.cli import app
    seen = []
    monkeypatch.setattr(pbkv.bench.main, "run", lambda args, console: seen.append(
        (args.pressures, args.tiers, args.cache.disk_tokens)))
    base = ["--workload", "swe", "--workflows", "2", "--concurrency", "2", "--out", str(tmp_path)]
    given = ["--pressure", "0.05", "--tiers", "device+host+disk", "--disk-tokens", "900"]
    for extra in ([], given):
        for command in ("bench", "ablate"):
            r = CliRunner().invoke(app, [command, *base, *extra])
            assert r.exit_code == 0, r.output
    assert seen == [("auto", [], None)] * 2 + [([0.05], ["device+host+disk"], 900)] * 2
