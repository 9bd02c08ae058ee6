"""Pure pieces of `pbkv serve --replicas N` (no Ray): /metrics merging, the retry decision,
what a replica reports to the router, each replica's folders, and `--replicas 1` staying a single
process without Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pbkv.scale.failover import Action, decide, route_hints
from pbkv.scale.metrics_merge import Merger
from pbkv.serve.metrics import Metrics, parse

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _replica_text(prompt: int, hits: int, queue: float, accuracy: float) -> str:
    m = Metrics()
    m.served(prompt, 5, {"device": hits, "host": 0, "disk": 0}, prompt - hits, False)
    m.requests.labels(endpoint="/x", status="200").inc(7)   # a replica's HTTP count: never shown
    extra = (f"# HELP pbkv_queue_depth q\n# TYPE pbkv_queue_depth gauge\npbkv_queue_depth {queue}\n"
             f"# HELP pbkv_cache_hit_rate r\n# TYPE pbkv_cache_hit_rate gauge\n"
             f"pbkv_cache_hit_rate{{tier=\"device\"}} {hits / prompt}\n"
             f"# HELP pbkv_predictor_accuracy a\n# TYPE pbkv_predictor_accuracy gauge\n"
             f"pbkv_predictor_accuracy {accuracy}\n")
    return m.exposition().decode() + extra


def test_merged_metrics_sum_counters_and_gauges_and_label_each_replica():
    ingress = Metrics()
    ingress.requests.labels(endpoint="/v1/completions", status="200").inc(3)
    ingress.prompt_tokens.inc(999)                 # the ingress's own engine families are dropped
    text = Merger().merge(ingress.exposition().decode(), {"b": _replica_text(100, 40, 2, 0.5),
                                                 "a": _replica_text(300, 60, 1, 0.7)}).decode()
    got = parse(text)
    assert got["pbkv_prompt_tokens_total"] == 400
    assert got['pbkv_prompt_tokens_total{replica="a"}'] == 300
    assert got['pbkv_prompt_tokens_total{replica="b"}'] == 100
    assert got['pbkv_cache_hit_tokens_total{tier="device"}'] == 100
    assert got['pbkv_cache_hit_tokens_total{replica="b",tier="device"}'] == 40
    assert got["pbkv_queue_depth"] == 3
    assert got['pbkv_requests_total{endpoint="/v1/completions",status="200"}'] == 3   # the ingress's only
    assert not any(k.startswith("pbkv_requests_total") and "replica" in k for k in got)
    assert got['pbkv_cache_hit_rate{tier="device"}'] == 100 / 400          # from the sums, not 0.4 + 0.2
    assert got['pbkv_cache_hit_rate{replica="a",tier="device"}'] == 0.2
    assert abs(got["pbkv_predictor_accuracy"] - 0.6) < 1e-12              # a mean, not a sum
    assert got["pbkv_request_latency_seconds_count"] == 0
    assert sum(k.startswith("pbkv_prompt_tokens_total") for k in got) == 3
    # the text parses back, one family per name, each replica's samples after the totals in id order
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    lines = [ln for ln in text.splitlines() if ln.startswith("pbkv_prompt_tokens_total")]
    assert lines == ["pbkv_prompt_tokens_total 400.0", 'pbkv_prompt_tokens_total{replica="a"} 300.0',
                     'pbkv_prompt_tokens_total{replica="b"} 100.0']


def test_merged_histograms_add_bucket_by_bucket():
    a, b = Metrics(), Metrics()
    a.latency.observe(0.003)
    b.latency.observe(0.2)
    b.latency.observe(0.3)
    a_text = a.exposition().decode().replace("pbkv_request_latency", "pbkv_engine_latency")
    b_text = b.exposition().decode().replace("pbkv_request_latency", "pbkv_engine_latency")
    got = parse(Merger().merge("", {"a": a_text, "b": b_text}).decode())
    assert got['pbkv_engine_latency_seconds_bucket{le="0.005"}'] == 1
    assert got['pbkv_engine_latency_seconds_bucket{le="0.5"}'] == 3
    assert got['pbkv_engine_latency_seconds_bucket{le="0.5",replica="b"}'] == 2
    assert got["pbkv_engine_latency_seconds_count"] == 3


def test_no_replica_answering_leaves_the_ingress_families():
    ingress = Metrics()
    ingress.requests.labels(endpoint="/metrics", status="200").inc()
    text = Merger().merge(ingress.exposition().decode(), {}).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {"pbkv_requests", "pbkv_request_latency_seconds", "pbkv_time_to_first_token_seconds"}
    assert parse(text)['pbkv_requests_total{endpoint="/metrics",status="200"}'] == 1


def test_retry_once_only_when_the_replica_was_lost_before_text_reached_the_client():
    assert decide(replica_lost=True, text_sent=False, retries=0) is Action.RETRY
    assert decide(replica_lost=True, text_sent=False, retries=1) is Action.FAIL     # once only
    assert decide(replica_lost=True, text_sent=True, retries=0) is Action.FAIL      # already streaming
    assert decide(replica_lost=False, text_sent=False, retries=0) is Action.ERROR   # the engine's own error
    assert decide(replica_lost=True, text_sent=False, retries=1, max_retries=2) is Action.RETRY
    assert decide(replica_lost=True, text_sent=False, retries=0, max_retries=0) is Action.FAIL


def test_route_hints_are_what_the_ray_router_reads():
    from pbkv.scale.adapter import route_request
    hints = route_hints("w1", None, [5, 6], 20, 8, avoid=["r1"])
    req = route_request([hints, "other"])
    assert (req.workflow_id, req.agent, req.hash_ids, req.input_tokens, req.output_tokens) == ("w1", "", (5, 6), 20, 8)
    assert hints["avoid"] == ["r1"] and "avoid" not in route_hints("w1", "a", [5], 3, 1)


def test_a_replica_reports_the_blocks_it_holds_per_tier_and_its_workflows():
    from pbkv.cache import RadixTree, Tier
    from pbkv.engine.hf import block_hashes
    from pbkv.scale.replica import cache_stats
    from pbkv.serve.workflows import Hints, WorkflowTable

    tree = RadixTree(4)
    table = WorkflowTable()
    run, _, _ = table.begin(Hints("wf", "a"), 0.0)
    ids = block_hashes(list(range(10)), 4)                  # 2 full blocks and a partial one
    node, _ = tree.insert(ids[:2], 4, Tier.DEVICE, 0.0)
    tree.touch(node, 0.0, run.workflow, "a")
    tree.insert(ids, 2, Tier.HOST, 0.0)
    engine = type("E", (), {"tree": tree})()
    stats = cache_stats(engine, table, 3, "r0")
    assert stats["tiers"] == {"device": ids[:2], "host": ids[2:], "disk": []}
    assert sorted(stats["blocks"]) == sorted(ids) and stats["workflows"] == {"wf": 8}
    assert (stats["id"], stats["load"], stats["block_size"]) == ("r0", 3.0, 4)
    assert stats["reuse"] == {}                            # no policy: nothing predicted
    policy = type("P", (), {"reuse_probability": lambda self, w: 0.25 if w == run.workflow else None})()
    engine.policy = policy
    assert cache_stats(engine, table, 3, "r0")["reuse"] == {"wf": 0.25}


def test_a_replica_reports_the_costs_it_measured_and_nothing_before():
    from pbkv.cache import RadixTree
    from pbkv.engine.hf.transfer import Rates
    from pbkv.scale.replica import cache_stats
    from pbkv.serve.workflows import WorkflowTable

    engine = type("E", (), {"tree": RadixTree(4), "rates": Rates(kv_bytes=64)})()
    assert cache_stats(engine, WorkflowTable(), 0, "r0")["costs"] == {}   # the prior rate is no measurement
    engine.rates.saw_prefill(8, 1.0)                                      # too small to count
    assert cache_stats(engine, WorkflowTable(), 0, "r0")["costs"] == {}
    engine.rates = Rates(kv_bytes=64, alpha=1.0)
    engine.rates.saw_prefill(400, 0.01)                                   # 40,000 tokens/s
    costs = cache_stats(engine, WorkflowTable(), 0, "r0", fetch_s_per_token=2e-6)["costs"]
    assert costs == {"prefill_s_per_token": pytest.approx(2.5e-5), "transfer_s_per_token": 2e-6}


def test_one_replica_serves_in_process_without_importing_ray():
    code = textwrap.dedent("""
        import sys
        import pbkv.serve
        from typer.testing import CliRunner
        from pbkv.cli import app
        seen = {}
        pbkv.serve.run = lambda cfg, log_level: seen.update(cfg=cfg)
        r = CliRunner().invoke(app, ["serve", "--port", "0", "--replicas", "1"])
        assert r.exit_code == 0, r.output
        assert seen["cfg"].model == "tiny"
        assert "ray" not in sys.modules, "ray was imported"
        r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--router", "nope"])
        assert r.exit_code == 2 and "unknown router 'nope'" in r.output, r.output
        r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--ray-address", "ray://h:10001"])
        assert r.exit_code == 2 and "cannot stream" in r.output, r.output
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]      # bound, not listening: a connection is refused
            r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", "0",
                                         "--ray-address", f"127.0.0.1:{closed}"])
        assert r.exit_code == 2 and "nothing answers there" in r.output, r.output
        assert "ray" not in sys.modules, "ray was imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_an_unreachable_or_malformed_ray_address_is_refused_at_once():
    import socket

    from pbkv.scale.options import check_reachable
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")   # something answers: accepted
    for ok in (None, "auto", "local"):
        check_reachable(ok)                                          # Ray's to resolve
    for bad, words in (("head-node", "expected auto or the head's HOST:PORT"), (":6379", "HOST:PORT"),
                       ("h:port", "HOST:PORT")):
        with pytest.raises(ValueError, match=words):
            check_reachable(bad)


def test_a_retry_avoids_the_lost_replica_while_another_remains():
    import pytest
    pytest.importorskip("ray")
    from types import SimpleNamespace as NS

    from pbkv.scale.ray_router import _without_avoided
    a, b = NS(replica_id=NS(unique_id="a")), NS(replica_id=NS(unique_id="b"))
    pending = NS(args=(route_hints("w", None, [1], 1, 1, avoid=["a"]),), kwargs={})
    assert _without_avoided([a, b], pending) == [b]
    assert _without_avoided([a], pending) == [a]                 # never none at all
    assert _without_avoided([a, b], NS(args=(route_hints("w", None, [1], 1, 1),), kwargs=None)) == [a, b]


def test_every_replica_gets_the_shared_dir_and_its_own_disk_dir(tmp_path, monkeypatch):
    import dataclasses

    import pytest
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    import pbkv.scale.serve_app as serve_app
    from pbkv.cli import app
    from pbkv.scale.replica import replica_config
    seen = {}
    monkeypatch.setattr(serve_app, "run", lambda cfg, opts, log_level, layout_checked=False:
                        seen.update(cfg=cfg, opts=opts))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["serve", "--replicas", "2", "--port", "0", "--router", "round-robin", "--shared-dir", "kv",
                                 "--shared-bytes", "1000000", "--disk-dir", "disk"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (seen["opts"].replicas, seen["opts"].router) == (2, "round-robin")
    assert (cfg.cache.shared_dir, cfg.cache.shared_bytes) == (str(tmp_path / "kv"), 1_000_000)  # absolute
    a, b = replica_config(cfg, "r1"), replica_config(cfg, "r2")
    assert a.cache.shared_dir == b.cache.shared_dir == cfg.cache.shared_dir
    assert (a.cache.disk_dir, b.cache.disk_dir) == (str(tmp_path / "disk" / "replica-r1"),
                                                    str(tmp_path / "disk" / "replica-r2"))
    assert dataclasses.replace(a, cache=cfg.cache) == cfg     # nothing else changes
    no_disk = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, disk_dir=None))
    assert replica_config(no_disk, "r1") is no_disk


def test_bench_serve_refuses_an_output_it_cannot_write_before_starting_ray(tmp_path, monkeypatch, capsys):
    import pytest
    pytest.importorskip("ray")
    import pbkv.scale.bench_serve as bench_serve
    monkeypatch.setattr(bench_serve, "start_ray", lambda *a, **k: pytest.fail("Ray started"))
    for out, words in ((tmp_path, "is a folder; give a file name"), (tmp_path / "f" / "x.jsonl", "is a file, so")):
        (tmp_path / "f").write_text("")
        with pytest.raises(SystemExit) as e:
            bench_serve.main(["--out", str(out)])
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_bench_serve_writes_its_rows_into_a_folder_it_makes(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace as NS

    import pytest
    pytest.importorskip("ray")
    import pbkv.scale.bench_serve as bench_serve
    monkeypatch.setattr(bench_serve, "start_ray", lambda *a, **k: None)
    monkeypatch.setattr(bench_serve, "workloads", lambda args: {"w": NS(calls=[])})
    monkeypatch.setattr(bench_serve, "run_cfg", lambda *a, **k: None)
    monkeypatch.setattr(bench_serve, "run_one", lambda cfg, router, trace, args: {"router": router})
    out = tmp_path / "results" / "rows.jsonl"   # results/ does not exist yet
    bench_serve.main(["--out", str(out), "--overhead-clients", "0", "--routers", "pbkv,prefix"])
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"workload": "w", "router": "pbkv"}, {"workload": "w", "router": "prefix"}]
