"""Memory regimes, verdict lines and the predictor cache of `pbkv bench`."""

from pathlib import Path

import pytest

from pbkv.bench import predictors
from pbkv.bench.regimes import (Regime, auto_regimes, distinct_prompt_tokens, largest_call, parse_pressures,
                                parse_tiers, regimes, workflow_tokens)
from pbkv.bench.run import Workload
from pbkv.bench.sweep import Source, SweepConfig, finish_records, sweep_jobs
from pbkv.bench.verdict import verdicts
from pbkv.trace import Call, Trace, TraceMeta


def tiny():
    # two workflows sharing block 1; block size 16; the last block of each prompt is partial
    calls = [Call("w0", 0, "a", 40, 4, [1, 2, 3]), Call("w0", 1, "a", 56, 4, [1, 2, 3, 4]),
             Call("w1", 0, "a", 20, 4, [1, 5])]
    return Workload("t", Trace(TraceMeta(block_size=16), calls))


def test_distinct_tokens_count_each_block_once_at_its_largest():
    wl = tiny()
    # 1: 16, 2: 16, 3: 16 (full in w0 step 1), 4: 8, 5: 4
    assert distinct_prompt_tokens(wl) == 60
    assert largest_call(wl) == 60
    assert workflow_tokens(wl) == (56 + 20) / 2


def test_regimes_by_pressure_and_tiers():
    wl = tiny()
    got = regimes(wl, [0.5, 1.0], ["device", "device+host", "device+host+disk"])
    # pressure 0.5 of 60 tokens is below the largest call (60): clamped up so the call can run,
    # and reported as the pressure it is (1.0), which makes it the same regimes as 1.0's: run once
    assert [(r.pressure, r.tiers, r.device_tokens, r.host_tokens, r.disk_tokens) for r in got] == [
        (1.0, "device", 60, 0, 0), (1.0, "device+host", 60, 120, 0), (1.0, "device+host+disk", 60, 120, 480)]
    assert regimes(wl, [], []) == [Regime()]
    # explicit capacities win: --device-tokens over pressure, --host-tokens over the ratio
    assert regimes(wl, [0.5], ["device+host"], device_tokens=500, host_tokens=7) == [
        Regime(None, "device+host", 500, 7, 0)]


def test_auto_regimes_come_from_the_working_set():
    wl = tiny()
    got = auto_regimes(wl, 100, [])
    assert [(r.tiers, r.device_tokens) for r in got] == [("device", 60), ("device+host", 60)]
    assert got[1].host_tokens == 120
    # with tier sets given, both auto shares clamp to the largest call here: each regime runs once
    assert [(r.tiers, r.device_tokens) for r in auto_regimes(wl, 1, ["device"])] == [("device", 60)]
    # --host-tokens 0 leaves no host tier: no regime labelled device+host runs without one
    assert {r.tiers for r in auto_regimes(wl, 100, [], host_tokens=0)} == {"device"}


def test_a_regimes_plot_column_without_a_tier_set_names_the_tiers_it_ran_with():
    from pbkv.bench.report import _tiers_below
    assert _tiers_below({"host_tokens": 40000, "disk_tokens": 0}) == "device + host 40,000"
    assert _tiers_below({"host_tokens": 0, "disk_tokens": 0}) == "device"


def test_parsing_errors_are_clear():
    assert parse_pressures("0.02,0.1") == [0.02, 0.1]
    with pytest.raises(ValueError, match="--pressure: a fraction"):
        parse_pressures("2")
    with pytest.raises(ValueError, match="--pressure: expected fractions"):
        parse_pressures("x")
    with pytest.raises(ValueError, match="--tiers: unknown tier set 'gpu'"):
        parse_tiers("device,gpu")
    with pytest.raises(ValueError, match="--tiers: device given twice"):
        parse_tiers("device,device")


def test_sweep_jobs_cross_regimes_and_speedups_are_per_regime():
    cfg = SweepConfig(sources=[Source("hover", spec="hover", workflows=5)], policies=["lru", "arc"],
                      concurrency=[2], pressures=[0.2, 0.3], tiers=["device"])
    jobs = sweep_jobs(cfg)
    assert [(j[1], j[4].pressure) for j in jobs] == [("lru", 0.2), ("arc", 0.2), ("lru", 0.3), ("arc", 0.3)]
    cfg.pressures = [0.01, 0.02]   # both below the largest call (0.1447 of the tokens here): one regime
    assert [(j[1], j[4].pressure) for j in sweep_jobs(cfg)] == [("lru", 0.1447), ("arc", 0.1447)]
    base = {"workload": "w", "concurrency": 2, "tiers": "device", "mean_workflow_latency_s": 10.0,
            "mean_ttft_s": 1.0, "device_hit_rate": 0.5}
    recs = finish_records([{**base, "policy": "lru", "pressure": 0.1},
                           {**base, "policy": "arc", "pressure": 0.1, "mean_workflow_latency_s": 5.0},
                           {**base, "policy": "lru", "pressure": 0.2, "mean_workflow_latency_s": 20.0},
                           {**base, "policy": "arc", "pressure": 0.2}])
    assert [r.get("speedup_vs_lru") for r in recs] == [None, 2.0, None, 2.0]


def test_verdict_line_per_workload():
    def rec(policy, speedup, tiers, pressure):
        r = {"workload": "hover", "policy": policy, "concurrency": 64, "tiers": tiers, "pressure": pressure,
             "device_tokens": 100, "host_tokens": 0, "disk_tokens": 0}
        if policy != "lru":
            r["speedup_vs_lru"] = speedup
        return r
    records = [rec("lru", 1, "device", 0.05), rec("arc", 1.05, "device", 0.05), rec("pbkv", 1.1, "device", 0.05),
               rec("oracle", 1.2, "device", 0.05),
               rec("lru", 1, "device+host", 0.02), rec("kvflow", 1.0, "device+host", 0.02),
               rec("pbkv", 1.0, "device+host", 0.02), rec("oracle", 1.01, "device+host", 0.02)]
    assert verdicts(records) == [
        "hover: pbkv 1.10x LRU, 1.05x the best peer (arc), 50% of the oracle's gain (1.20x) "
        "[device, pressure 0.05, conc 64]; pbkv 1.00x LRU, 1.00x the best peer (kvflow), the oracle gains "
        "under 2% here (1.0100x) [device+host, pressure 0.02, conc 64]"]


def test_generated_workload_predictors_are_cached_by_workload_seed_and_code(tmp_path, monkeypatch):
    monkeypatch.setenv("PBKV_CACHE", str(tmp_path))
    trained = []

    def fake_train(data, variant, psrc, folder, progress):
        trained.append(folder)
        from pathlib import Path

        from pbkv.predict.store import publish
        publish(folder, lambda d: (Path(d) / "config.json").write_text("{}"))  # a real save's layout
        return folder
    monkeypatch.setattr(predictors, "_train_and_save", fake_train)
    src = Source("hover", spec="hover", workflows=10, seed=3)
    first = predictors.prepare([src], ["pbkv"], predictors.PredictorSource(), tmp_path / "out")
    again = predictors.prepare([src], ["pbkv"], predictors.PredictorSource(), tmp_path / "out")
    other = predictors.prepare([Source("hover", spec="hover", workflows=10, seed=4)], ["pbkv"],
                               predictors.PredictorSource(), tmp_path / "out")
    assert first == again and len(trained) == 2 and first != other
    folder = first[("hover", "fused")]
    assert folder.startswith(str(tmp_path)) and "seed4" in folder and predictors.code_version() in folder


def test_a_run_loads_only_the_predictor_its_policy_reads(monkeypatch):
    """LRU and the peers read no trained predictor: loading one (and batching its answers for the
    whole trace) for every run was a third of the default bench's CPU time."""
    from pbkv.bench import sweep
    loaded = []
    monkeypatch.setattr(sweep.predictors_mod, "load", lambda path: loaded.append(path))
    monkeypatch.setattr(sweep, "simulate", lambda workload, run: {"predictors": sorted(run.predictors)})
    cfg = SweepConfig(sources=[Source("hover", spec="hover", workflows=5)], policies=["lru", "arc", "pbkv"],
                      concurrency=[2], jobs=1, predictors={("hover", "fused"): "F", ("hover", "history"): "H",
                                                           ("swe", "fused"): "S"})
    got = {job[1]: sweep._run_one(job)["predictors"] for job in sweep_jobs(cfg)}
    assert got == {"lru": [], "arc": [], "pbkv": ["fused"]}
    assert loaded == ["F"]


def test_verdict_peers_leave_out_pbkv_subclasses_and_future_readers(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))

    def rec(policy, speedup):
        return {"workload": "swe", "policy": policy, "concurrency": 8, "tiers": "device", "pressure": 0.05,
                "speedup_vs_lru": speedup}
    records = [rec("lru", 1.0), rec("pbkv", 1.1), rec("ablation_policies:NoDead", 1.3),
               rec("pbkv-perfect", 1.25), rec("slru", 1.02), rec("vllm", 1.04), rec("oracle", 1.2)]
    assert verdicts(records) == [
        "swe: pbkv 1.10x LRU, 1.06x the best peer (vllm), 50% of the oracle's gain (1.20x) "
        "[device, pressure 0.05, conc 8]"]
    # a peer named by its class path is a peer, though the path starts with "pbkv"
    records.append(rec("pbkv.policy.scalesim:ScaleSimPolicy", 1.05))
    assert "the best peer (pbkv.policy.scalesim:ScaleSimPolicy)" in verdicts(records)[0]


def test_verdict_gives_each_router_of_a_cluster_run_its_own_segment():
    def rec(policy, speedup, router):
        return {"workload": "swe", "policy": policy, "concurrency": 8, "tiers": "device", "pressure": 0.05,
                "speedup_vs_lru": speedup, "router": router, "instances": 2}
    records = [rec(p, s, router) for router, pb in (("prefix", 1.00), ("pbkv", 1.10))
               for p, s in (("lru", 1.0), ("pbkv", pb), ("oracle", 1.2))]
    line, = verdicts(records)
    assert "pbkv 1.00x LRU" in line and "router prefix, 2 instances" in line
    assert "pbkv 1.10x LRU" in line and "router pbkv, 2 instances" in line


def test_verdict_words_agree_with_the_printed_oracle_figure():
    """Before: "the oracle gains nothing here (1.02x)" for an oracle at 1.0159x (the test used the
    unrounded gain, the figure was rounded); then a share computed for gains down to 1.5% (two
    speedups printed as 1.02x gave "132% of the oracle's gain"). Now the test uses the unrounded
    gain and the figure below the threshold is printed to four decimals."""
    def recs(oracle):
        base = {"workload": "hover", "concurrency": 8, "tiers": "device", "pressure": 0.05}
        return [{**base, "policy": "lru"}, {**base, "policy": "kvflow", "speedup_vs_lru": 1.01244},
                {**base, "policy": "pbkv", "speedup_vs_lru": 1.00271}, {**base, "policy": "oracle", "speedup_vs_lru": oracle}]
    line, = verdicts(recs(1.01588))
    assert "the oracle gains under 2% here (1.0159x)" in line and "oracle's gain" not in line
    line, = verdicts(recs(1.0201))
    assert "13% of the oracle's gain (1.02x)" in line


def test_a_clamped_pressure_is_named_on_the_terminal(tmp_path):
    """--pressure fractions below the largest call are clamped up (the call must fit) and two of
    them merged into one regime; that used to happen silently."""
    from pbkv.bench.regimes import clamp_note
    assert clamp_note(tiny(), [1.0]) is None
    assert clamp_note(tiny(), [0.5, 1.0]) == (
        "t: --pressure 0.5 is below the largest call (60 tokens of 60 distinct prompt tokens), which could "
        "never run; ran at pressure 1 (device 60 tokens) instead")
    from typer.testing import CliRunner

    from pbkv.cli import app
    r = CliRunner().invoke(app, ["bench", "--workload", "hover", "--workflows", "5", "--pressure", "0.001,0.002",
                                 "--tiers", "device", "--policies", "lru", "--out", str(tmp_path)])
    said = " ".join(r.output.split())   # the console wraps lines at its width
    assert r.exit_code == 0, r.output
    assert ("note: hover: --pressure 0.001, 0.002 are below the largest call (3,873 tokens" in said
            and "ran at pressure 0.1447 (device 3,873 tokens) instead; the 2 clamped fractions are one regime, "
                "run once" in said), r.output
    # --device-tokens wins over --pressure: nothing is clamped, nothing to say
    r = CliRunner().invoke(app, ["bench", "--workload", "hover", "--workflows", "5", "--pressure", "0.001",
                                 "--device-tokens", "5000", "--policies", "lru", "--out", str(tmp_path)])
    assert r.exit_code == 0 and "note:" not in r.output, r.output


def test_a_cached_predictor_follows_the_umask(tmp_path):
    """Before: the cache entry was mkdtemp's folder, 0700: another account sharing $PBKV_CACHE
    saw no predictor there, trained it again and could not replace the entry."""
    import os
    trace = Path(__file__).parent / "data" / "chatdev-mini.jsonl"
    folder = tmp_path / "predictors" / "entry"
    old = os.umask(0o022)
    try:
        predictors._train_and_save((str(trace),), "fused", predictors.PredictorSource(epochs=1), folder, None)
    finally:
        os.umask(old)
    assert predictors.has_predictor(folder) and folder.stat().st_mode & 0o777 == 0o755


def test_a_file_in_place_of_a_cached_predictor_is_replaced(tmp_path, monkeypatch):
    """Before: rmtree(ignore_errors) left the file, the rename failed and was taken for "another
    run finished first": the predictor just trained was thrown away and bench failed, every run."""
    from pbkv.predict import train
    from pbkv.trace import read_trace
    trace = Path(__file__).parent / "data" / "chatdev-mini.jsonl"
    trained = train.train_predictor(read_trace(trace), epochs=1, seed=0)
    monkeypatch.setattr(train, "train_predictor", lambda traces, progress=None, **kwargs: trained)
    folder = tmp_path / "predictors" / "entry"
    folder.parent.mkdir()
    folder.write_text("")                          # an empty file left in the entry's place
    predictors._train_and_save((str(trace),), "fused", predictors.PredictorSource(), folder, None)
    assert predictors.has_predictor(folder)
    # a rename that fails with no predictor there afterwards is an error naming the entry
    def refused(self, target):
        raise OSError(13, "Permission denied")
    (tmp_path / "other").write_text("")
    monkeypatch.setattr(Path, "rename", refused)
    with pytest.raises(OSError, match=rf"{tmp_path / 'other'}: cannot put the predictor just trained in place"):
        predictors._train_and_save((str(trace),), "fused", predictors.PredictorSource(), tmp_path / "other", None)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("other.")] == []   # its temporary folder is gone
