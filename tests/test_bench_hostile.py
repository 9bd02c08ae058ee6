"""`pbkv bench` regressions found by hostile testing: tiers and capacities given explicitly,
makespan of open-loop traces, the verdict's regime label, and plot lines."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbkv.bench.regimes import DISK_RATIO, HOST_RATIO
from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile
from pbkv.trace import Call, Trace, TraceMeta

PROFILE = load_profile("a6000-qwen3-32b")
MINI = Path(__file__).resolve().parent / "data" / "bfcl-mini.jsonl"


def bench(*args, tmp_path):
    """`pbkv bench` on the bfcl-mini fixture, LRU (and the oracle) only."""
    from pbkv.cli import app
    argv = ["bench", "--trace", MINI, "--policies", "lru", "--concurrency", 4, "--jobs", 1, "--out", tmp_path, *args]
    return CliRunner().invoke(app, [str(a) for a in argv])


def sweep_regimes(**kw):
    from pbkv.bench.sweep import Source, SweepConfig, sweep_jobs
    cfg = SweepConfig(sources=[Source("mini", trace=str(MINI))], policies=["lru"], concurrency=[4], **kw)
    return list(dict.fromkeys(job[4] for job in sweep_jobs(cfg)))


def test_profile_pressure_with_tier_sets_runs_exactly_those_tiers_at_the_documented_ratios():
    # --pressure profile --tiers device,device+host+disk: the profile's device; host 2x, disk 8x
    # it (the profile's own disk is 0 and its host_ratio is for runs without a tier set)
    device = PROFILE.device_tokens
    got = sweep_regimes(pressures=None, tiers=["device", "device+host+disk"])
    assert [(r.tiers, r.device_tokens, r.host_tokens, r.disk_tokens) for r in got] == [
        ("device", device, 0, 0), ("device+host+disk", device, HOST_RATIO * device, DISK_RATIO * device)]
    # explicit sizes win over the ratios
    got = sweep_regimes(pressures=None, tiers=["device+host+disk"], cache=CacheConfig(host_tokens=777, disk_tokens=999))
    assert [(r.device_tokens, r.host_tokens, r.disk_tokens) for r in got] == [(device, 777, 999)]
    # no tier set: the profile's tiers, as before
    assert [(r.tiers, r.device_tokens, r.host_tokens, r.disk_tokens) for r in sweep_regimes(pressures=None)] == [
        (None, None, None, None)]


def test_the_cli_runs_a_disk_tier_when_asked(tmp_path):
    import json
    r = bench("--pressure", "profile", "--tiers", "device+host+disk", tmp_path=tmp_path)
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "bench.json").read_text())[0]
    assert rec["tiers"] == "device+host+disk" and rec["disk_tokens"] == DISK_RATIO * rec["device_tokens"] > 0


@pytest.mark.parametrize("args, message", [
    (("--tiers", "device+host", "--host-tokens", 0), "--tiers device+host has a host tier but --host-tokens is 0"),
    (("--tiers", "device,device+host+disk", "--disk-tokens", 0),
     "--tiers device+host+disk has a disk tier but --disk-tokens is 0"),
    (("--tiers", "device", "--host-tokens", 500), "--host-tokens 500: none of --tiers device has a host tier"),
    (("--tiers", "device,device+host", "--disk-tokens", 500),
     "--disk-tokens 500: none of --tiers device,device+host has a disk tier")])
def test_sizes_that_contradict_the_tier_sets_are_refused(tmp_path, args, message):
    r = bench("--pressure", "profile", *args, tmp_path=tmp_path)
    assert r.exit_code != 0 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "bench.json").exists()


def timed(offset: float) -> Workload:
    """Two one-call workflows arriving `offset` and `offset` + 1 s into the trace."""
    calls = [Call("a", 0, "x", 32, 2, [0, 1], t=offset), Call("b", 0, "x", 32, 2, [2, 3], t=offset + 1.0)]
    return Workload("t", Trace(TraceMeta(), calls))


def test_open_loop_makespan_runs_from_the_first_arrival():
    # the same two workflows, shifted 1000 s later: the same makespan, not 1000 s more
    early = simulate(timed(0.0), RunConfig("lru", None, PROFILE, cache=CacheConfig(device_tokens=1000)))
    late = simulate(timed(1000.0), RunConfig("lru", None, PROFILE, cache=CacheConfig(device_tokens=1000)))
    assert 1.0 < early["makespan_s"] < 100.0
    assert late["makespan_s"] == pytest.approx(early["makespan_s"])


def test_verdict_names_given_capacities_not_profile_tiers():
    from pbkv.bench.verdict import verdicts

    def rec(policy, speedup):   # --device-tokens 40000 --host-tokens 40000 --disk-tokens 200000: no tier set
        r = {"workload": "hover", "policy": policy, "concurrency": 16, "tiers": None, "pressure": None,
             "device_tokens": 40000, "host_tokens": 40000, "disk_tokens": 200000}
        return r if policy == "lru" else {**r, "speedup_vs_lru": speedup}
    line, = verdicts([rec("lru", 1.0), rec("pbkv", 1.1), rec("oracle", 1.2)])
    assert "profile tiers" not in line
    assert line.endswith("[device 40,000 + host 40,000 + disk 200,000 tokens, conc 16]")
    device_only = [{**r, "host_tokens": 0, "disk_tokens": 0} for r in (rec("lru", 1.0), rec("pbkv", 1.1))]
    assert verdicts(device_only)[0].endswith("[device 40,000 tokens, conc 16]")


def plotted_lines(monkeypatch, tmp_path, records) -> dict[str, list[tuple]]:
    """{plot file name: [(label, xs) of every line of its axes]} as `write_plots` draws them."""
    from pbkv.bench import report
    drawn = {}

    def save(plt, fig, axes, path):
        drawn[path.name] = [(line.get_label(), list(line.get_xdata())) for ax in axes for line in ax.get_lines()]
        plt.close(fig)
        return path
    monkeypatch.setattr(report, "_save", save)
    report.write_plots(records, tmp_path)
    return drawn


def cluster_records() -> list[dict]:
    """lru and pbkv behind the pbkv router on 2 and 4 instances, at two concurrencies and two
    device sizes (the order `--instances 2,4` writes them: instances inside concurrency)."""
    out = []
    for device in (1000, 2000):
        for conc in (16, 32):
            for n in (2, 4):
                for policy in ("lru", "pbkv"):
                    out.append({"workload": "w", "policy": policy, "concurrency": conc, "tiers": "device",
                                "pressure": None, "device_tokens": device, "host_tokens": 0, "disk_tokens": 0,
                                "router": "pbkv", "instances": n, "device_hit_rate": 0.1 * n,
                                **({"speedup_vs_lru": 1.0 + n / 100} if policy != "lru" else {})})
    return out


def test_plot_lines_never_join_runs_of_different_instance_counts(monkeypatch, tmp_path):
    drawn = plotted_lines(monkeypatch, tmp_path, cluster_records())
    assert set(drawn) == {"w.png", "w-regimes.png"}
    for name, lines in drawn.items():
        for label, xs in lines:
            # one point per x: a line through both instance counts visits each x twice
            assert xs == sorted(set(xs)), (name, label, xs)
        labels = {label for label, _ in lines}
        assert labels == {"lru / pbkv x2", "pbkv / pbkv x2", "lru / pbkv x4", "pbkv / pbkv x4"}, name


def test_with_auto_pressure_the_concurrency_plot_follows_each_concurrencys_own_capacity(monkeypatch, tmp_path):
    """`--pressure auto --concurrency 16,32`: each concurrency has its own device size (from its
    working set) and two regimes; the concurrency plot's lines hold the first tier set's runs at
    both concurrencies (before: only concurrency 16's, one point per line)."""
    records = []
    for conc, device in ((16, 33372), (32, 66745)):
        for tiers, size, host in (("device", device, 0), ("device+host", device * 2 // 5, device * 4 // 5)):
            for policy in ("lru", "pbkv"):
                records.append({"workload": "w", "policy": policy, "concurrency": conc, "tiers": tiers,
                                "pressure": round(size / 958_000, 4), "device_tokens": size, "host_tokens": host,
                                "disk_tokens": 0, "device_hit_rate": 0.2,
                                **({"speedup_vs_lru": 1.1} if policy != "lru" else {})})
    drawn = plotted_lines(monkeypatch, tmp_path, records)
    assert sorted(drawn["w.png"]) == [("lru", [16, 32])] * 2 + [("pbkv", [16, 32])] * 2


def test_bench_refuses_a_disk_tier_below_no_host_tier(tmp_path):
    # before: the run went ahead and its disk (5000 tokens in the record) was never written to
    r = bench("--pressure", "profile", "--device-tokens", 240, "--host-tokens", 0, "--disk-tokens", 5000,
              tmp_path=tmp_path)
    assert r.exit_code != 0, r.output
    assert "--disk-tokens 5000 with --host-tokens 0" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "bench.json").exists()


def test_a_second_run_into_the_same_out_removes_the_first_runs_plots(tmp_path):
    """Before: hover.png of an earlier run stayed beside a bench.json holding only swe."""
    from typer.testing import CliRunner

    from pbkv.cli import app
    args = ["bench", "--workflows", "4", "--concurrency", "2", "--policies", "lru", "--out", str(tmp_path),
            "--jobs", "1"]
    assert CliRunner().invoke(app, [*args, "--workload", "hover"]).exit_code == 0
    (tmp_path / "notes.png").write_text("a user's file")   # not a plot of bench.json's workloads: kept
    assert (tmp_path / "hover.png").is_file()
    r = CliRunner().invoke(app, [*args, "--workload", "swe"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "notes.png", "swe.png"]
    want = f"removed an earlier run's plots (not of this run's workloads): {tmp_path / 'hover.png'}"
    assert "".join(want.split()) in "".join(r.output.split())
