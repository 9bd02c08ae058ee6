"""`pbkv.bench.vllm_run.replay` (the worker side of `pbkv bench --engine vllm`) over a stand-in
`vllm` module: what each call sends, and the figures, without an engine."""

import json
import sys
import time

import pytest

from pbkv.trace import Call, Trace, TraceMeta, write_trace

STUB = '''
import json, os, time
from types import SimpleNamespace
SENT = []
FIRST = {"seconds": 0.01}
class SamplingParams:
    def __init__(self, **kw): self.__dict__.update(kw)
class LLM:
    def __init__(self, **kw): self.kw = kw
    def get_tokenizer(self): return SimpleNamespace(vocab_size=49152)
    def generate(self, prompts, params, use_tqdm=False):
        SENT.extend(p.extra_args["kv_transfer_params"] for p in params)
        time.sleep(0.2)   # the whole wave: every call's decode
        metrics = (SimpleNamespace(first_token_latency=FIRST["seconds"]) if self.kw.get("disable_log_stats") is False
                   else None)
        return [SimpleNamespace(num_cached_tokens=0, outputs=[], metrics=metrics) for _ in prompts]
'''


@pytest.fixture
def stub(tmp_path, monkeypatch):
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(STUB)
    monkeypatch.syspath_prepend(str(tmp_path / "stub"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    import vllm
    yield vllm
    sys.modules.pop("vllm", None)


def call(w, step, length):
    return Call(workflow_id=w, step=step, agent="a", input_length=length, output_length=2,
                hash_ids=list(range(step * 100, step * 100 + -(-length // 16))))


def job(tmp_path, calls, policy="vllm"):
    trace = write_trace(Trace(TraceMeta(block_size=16), calls), tmp_path / "trace.jsonl")
    return {"model": "m", "trace": str(trace), "policy": policy, "concurrency": 2, "seed": 0, "max_model_len": 512,
            "max_tokens": 4, "blocks": 24, "host_tokens": 0, "disk_tokens": 0, "stats": str(tmp_path / "s.json")}


def test_workflow_done_goes_on_the_last_call_sent(tmp_path, stub):
    """The workflow's last call is over the length limit and skipped: workflow_done used to go
    only on it, so the connector never heard the workflow end."""
    from pbkv.bench.vllm_run import replay
    fig = replay(job(tmp_path, [call("a", 0, 100), call("a", 1, 200), call("a", 2, 600),
                                call("b", 0, 50), call("b", 1, 60)]))
    assert fig["calls"] == 4 and fig["skipped"] == 1
    done = {(h["workflow_id"]): h for h in stub.SENT if h["workflow_done"]}
    assert set(done) == {"a", "b"}
    assert [h["workflow_done"] for h in stub.SENT if h["workflow_id"] == "a"] == [False, True]


def test_ttft_is_the_request_first_token_time_not_the_wave(tmp_path, stub):
    """Every call of a wave got the wave's whole generate() time (0.2 s here) as its TTFT."""
    from pbkv.bench.vllm_run import replay
    fig = replay(job(tmp_path, [call("a", 0, 100), call("b", 0, 100)]))
    assert fig["mean_ttft_s"] == pytest.approx(0.01) and fig["p99_ttft_s"] == pytest.approx(0.01)
    stub.FIRST["seconds"] = 0.0   # not measured: no TTFT rather than a wrong one
    fig = replay(job(tmp_path, [call("a", 0, 100), call("b", 0, 100)]))
    assert fig["mean_ttft_s"] is None and fig["p99_ttft_s"] is None


def test_unmeasured_ttft_gives_no_speedup_and_a_dash(tmp_path):
    from pbkv.bench.report import print_tables
    from pbkv.bench.sweep import finish_records
    from pbkv.bench.vllm_run import to_record
    raw = {"policy": "vllm", "workflows": 2, "calls": 3, "skipped": 0, "prompt_tokens": 10, "computed_tokens": 5,
           "wall_s": 1.0, "mean_workflow_latency_s": 1.0, "p99_workflow_latency_s": 1.0, "mean_ttft_s": None,
           "p99_ttft_s": None, "gpu_hit_tokens": 0, "host_hit_tokens": 0, "disk_hit_tokens": 0,
           "gpu_demoted_blocks": 0}
    j = {"model": "/m/x", "scale": 12.0, "blocks": 24, "host_tokens": 512, "disk_tokens": 0, "concurrency": 2}
    recs = finish_records([to_record(raw, j, "hover"), to_record(dict(raw, policy="lru"), j, "hover")])
    assert recs[1]["mean_ttft_s"] is None and "ttft_speedup_vs_lru" not in recs[1]
    assert recs[1]["speedup_vs_lru"] == 1.0
    print_tables(recs)
