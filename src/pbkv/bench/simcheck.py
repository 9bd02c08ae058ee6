"""`pbkv calibrate` and `pbkv simcheck`: how well does the simulator predict the real engine?

`simcheck` replays one small workload twice per policy, with the same scaled trace, capacities,
concurrency and predictor: on the real engine (wall clock) and on the simulator with a profile
calibrated on this machine (`pbkv calibrate`), and prints both side by side. Differences come
from what the simulator does not model (Python overheads, sequential decode, the worker
thread's timing), so they show where its figures can be trusted.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from pbkv.bench import predictors as predictors_mod
from pbkv.bench.hf_run import HFConfig, get_model, hf_capacities, run_hf, scale_workload
from pbkv.bench.regimes import distinct_prompt_tokens, largest_call, pressure_device
from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.bench.sweep import Source, load_workload
from pbkv.cache import CacheConfig, Capacities
from pbkv.engine.profiles import Profile, load_profile, profile_from_data
from pbkv.files import replaced_on_success

COMPARED = [("mean_workflow_latency_s", "lat s", False), ("mean_ttft_s", "TTFT s", False),
            ("device_hit_rate", "dev %", True), ("host_hit_rate", "host %", True),
            ("disk_hit_rate", "disk %", True), ("recomputed_tokens", "recomp", False)]


def calibrate(hf: HFConfig, output: Path, max_len: int = 512, repeats: int = 2) -> dict:
    """Measure the model of `hf` on this machine; write and return the profile JSON.

    Invariants: `output` is checked before anything is measured (`check_profile_output`); the
    profile is validated by content before it is written, and the write replaces `output` whole
    (a profile the simulator would refuse never reaches the disk, nor replaces a good one)."""
    from pbkv.engine.hf.calibrate import measure, to_profile
    check_profile_output(output)
    lm = get_model(hf)
    profile = to_profile(lm, measure(lm, max_len, repeats, hf.seed), name=f"calibrated-{lm.name}")
    profile_from_data(profile, f"the profile measured for {output}")  # the simulator must accept it
    with replaced_on_success(output) as tmp:
        tmp.write_text(json.dumps(profile, indent=1) + "\n")
    return profile


def check_profile_output(output: Path) -> None:
    """A ValueError unless `output` can take a profile that `--profile` reads back: a name ending
    in .json (`load_profile` reads any other name as a built-in's) that is not a folder."""
    if output.suffix != ".json":
        raise ValueError(f"{output}: a profile must be a .json file for --profile to read it")
    if output.is_dir():
        raise ValueError(f"{output} is a folder; give a file name")


def simcheck(source: Source, policies: list[str], concurrency: int | None, hf: HFConfig, profile: str,
             cache: CacheConfig, predictor: predictors_mod.PredictorSource, out: Path, progress=None,
             note=None) -> list[dict]:
    """Per policy, a record with `real_<key>` and `sim_<key>` for the figures in COMPARED.
    `note(line)` hears a warning when the profile is another model's (`shape_mismatch`)."""
    workload = load_workload(source)
    scaled = scale_workload(workload, hf)
    cache = pressured(cache, scaled)
    paths = predictors_mod.prepare([source], policies, predictor, out / "models")
    predictors = {variant: predictors_mod.load(path) for (_, variant), path in paths.items()}
    prof = load_profile(profile)
    check_load_rule(hf.load_rule, hf_capacities(scaled, RunConfig(policy=policies[0], concurrency=concurrency,
                                                                   profile=prof, cache=cache)))
    mismatch = shape_mismatch(prof, model_shape(get_model(hf)))
    if mismatch and note:
        note(mismatch)
    rows = []
    for policy in policies:
        run = RunConfig(policy=policy, concurrency=concurrency, profile=prof, predictors=predictors, cache=cache)
        real = run_hf(workload, run, hf)
        c = hf_capacities(scaled, run)
        sim = simulate(scaled, replace(run, cache=CacheConfig(c.device, c.host, c.disk)))
        row = {"policy": policy, "device_tokens": c.device, "host_tokens": c.host, "disk_tokens": c.disk}
        for key, _, _ in COMPARED:
            row[f"real_{key}"], row[f"sim_{key}"] = real[key], sim[key]
        rows.append(row)
        if progress:
            progress(row)
    return rows


SHAPE = ("layers", "heads", "kv_heads", "head_dim", "dtype_bytes")


def model_shape(lm) -> dict:
    """The loaded model's shape as a profile's `model` names it (`ModelShape`)."""
    import torch
    return {"name": lm.name, "params_b": sum(p.numel() for p in lm.model.parameters()) / 1e9, "layers": lm.layers,
            "heads": lm.model.config.num_attention_heads, "kv_heads": lm.kv_heads, "head_dim": lm.head_dim,
            "dtype_bytes": torch.finfo(lm.dtype).bits // 8}


def shape_mismatch(prof: Profile, shape: dict) -> str | None:
    """A warning when profile `prof` describes another model than `shape` (`model_shape`): a
    layer, head or dtype count differs, or the parameters by more than 1%. The simulator's costs
    and capacities are then another model's, and simcheck compares little."""
    m = prof.model
    differs = [k for k in SHAPE if getattr(m, k) != shape[k]]
    if abs(m.params_b - shape["params_b"]) > 0.01 * max(m.params_b, shape["params_b"]):
        differs.insert(0, "params")

    def text(x) -> str:
        return (f"{x['name']}: {x['params_b'] * 1e3:.4g} M params, {x['layers']} layers, {x['heads']} heads, "
                f"{x['kv_heads']} KV heads x {x['head_dim']}, {x['dtype_bytes']}-byte dtype")
    if not differs:
        return None
    return (f"warning: profile {prof.name} is for another model than the one replayed (they differ in "
            f"{', '.join(differs)}): {text(m.model_dump())}, replayed {text(shape)}; the simulator's costs and "
            f"capacities are that model's (pbkv calibrate --model {shape['name']} measures this one)")


def check_load_rule(load_rule: str, c: Capacities) -> None:
    """A ValueError when the two engines would do different work by rule: the simulator has no load
    rule (it always loads a host/disk prefix back), so with a host or disk tier the real engine's
    `--load-rule recompute` (never load) recomputes what the simulator loads (before, every check
    still said PASS on that). `auto` may also recompute: `work_check` compares what was done."""
    if load_rule == "recompute" and (c.host or c.disk):
        raise ValueError(f"--load-rule recompute: the simulator always loads host/disk prefixes back (it has no "
                         f"load rule), so with a host or disk tier (host {c.host:,}, disk {c.disk:,} tokens) the two "
                         f"engines would do different work; use --load-rule load (or auto), or --host-tokens 0 "
                         f"--disk-tokens 0")


PRESSURE = 0.3   # the default device: this fraction of the scaled workload's distinct prompt tokens
# (as `--pressure 0.3` sizes it in `pbkv bench`). Measured on hover x8 at concurrency 4 (tiny, scale
# 8): at 0.3 LRU, kvflow, pbkv and the oracle recompute 7-25% apart and both engines rank them
# alike; at ~0.17 (bench's auto device share) the interleaving of the 4 lanes moves the policies'
# recomputed tokens by a few % from run to run on either engine, so the ranks disagree at random.


def pressured(cache: CacheConfig, scaled: Workload) -> CacheConfig:
    """simcheck's capacities: given ones as they are; with no device size, `PRESSURE` of the
    scaled workload's distinct prompt tokens (never below its largest call: `pressure_device`),
    and no host or disk tier unless given.
    Why: the real engine's default (8 x the longest call) holds the whole small workload, so every
    policy did the same work and the check compared nothing but timing noise."""
    if cache.device_tokens is not None:
        return cache
    _, device = pressure_device(PRESSURE, distinct_prompt_tokens(scaled), largest_call(scaled))
    return replace(cache, device_tokens=device, host_tokens=cache.host_tokens or 0,
                   disk_tokens=cache.disk_tokens or 0)


def table(rows: list[dict], title: str, profile: str = "the calibrated profile") -> Table:
    """The figures side by side; the caption names the simulator's `profile`."""
    t = Table(title=title, caption=f"each figure: real engine / simulator on {profile}")
    t.add_column("policy")
    for _, label, _ in COMPARED:
        t.add_column(label, justify="right", no_wrap=True)
    for r in rows:
        cells = []
        for key, _, pct in COMPARED:
            a, b = r[f"real_{key}"], r[f"sim_{key}"]
            cells.append(f"{100 * a:.1f} / {100 * b:.1f}" if pct else f"{a:.3g} / {b:.3g}")
        t.add_row(r["policy"], *cells)
    return t


TIE = 0.02  # figures within 2% of each other are tied: the real engine's timing noise is about 1%


def verdict(rows: list[dict], tolerance: float = 0.15, tie: float = TIE) -> list[str]:
    """The simulator's check against the real engine (docs/benchmarks.md, `pbkv simcheck`): do both engines rank the policies the same (by
    mean workflow latency, and by recomputed tokens), and does each policy's speedup over LRU
    agree within `tolerance` (|real / sim - 1|)? Lines to print; each says PASS or FAIL.

    Invariants: two figures within `tie` (relative) are tied, and a tie makes no rank claim; the
    rank test FAILs only on a pair that both engines order strictly, and oppositely. So the
    verdict does not depend on the rows' order, the policies' names or noise inside `tie`. A
    policy that did the same work as LRU on the simulator (`same_work`) has no speedup to check:
    its line starts with "--" rather than PASS or FAIL."""
    lines = []
    for key, what in (("mean_workflow_latency_s", "latency"), ("recomputed_tokens", "recomputed tokens")):
        real, sim = f"real_{key}", f"sim_{key}"
        wrong = disagreements(rows, real, sim, tie)
        ok = "FAIL" if wrong else "PASS"
        lines.append(f"{ok} rank by {what}: real {ranking(rows, real, tie)}; simulated {ranking(rows, sim, tie)}"
                     + (f" (disagree: {', '.join(wrong)})" if wrong else ""))
    lru = next((r for r in rows if r["policy"] == "lru"), None)
    if lru is not None and len(rows) > 1 and all(same_work(r, lru) for r in rows):
        lines.append("-- speedups over lru not compared: all policies did identical work on the simulator "
                     "(same hits, same recomputed tokens), so the real engine's differences are timing noise; "
                     "give less memory (--device-tokens) for policies that differ")
    elif lru is not None:
        key = "mean_workflow_latency_s"
        for r in rows:
            if r is lru:
                continue
            if same_work(r, lru):
                lines.append(f"-- {r['policy']} speedup over lru not compared: the same work as lru on the "
                             f"simulator (same hits, same recomputed tokens): the real difference is timing noise")
                continue
            real = lru[f"real_{key}"] / r[f"real_{key}"]
            sim = lru[f"sim_{key}"] / r[f"sim_{key}"]
            ok = "PASS" if abs(real / sim - 1) <= tolerance else "FAIL"
            lines.append(f"{ok} {r['policy']} speedup over lru: real {real:.3f}x, simulated {sim:.3f}x "
                         f"({100 * (real / sim - 1):+.1f}%, tolerance {100 * tolerance:.0f}%)")
    line = work_check(rows, tolerance)
    if line:
        lines.append(line)
    return lines


HIT_TOLERANCE = 0.05  # hit rates of the two engines within 5 points: the same work


def work_check(rows: list[dict], tolerance: float = 0.15, hits: float = HIT_TOLERANCE) -> str | None:
    """Did each policy do the same work on both engines: recomputed tokens within `tolerance`
    (|real / simulated - 1|) and each tier's hit rate within `hits` (absolute)? A PASS or FAIL line naming what
    differs (None when the rows carry none of these figures). Without it, engines doing different
    work (e.g. the real one recomputing host/disk prefixes the simulator loads) could PASS every
    rank and speedup check."""
    wrong, seen = [], False
    for r in rows:
        for key in WORK:
            a, b = r.get(f"real_{key}"), r.get(f"sim_{key}")
            if a is None or b is None:
                continue
            seen = True
            if key == "recomputed_tokens":
                if abs(a - b) > tolerance * abs(b) or (b == 0 and a != 0):
                    wrong.append(f"{r['policy']} recomputed tokens real {a:,} / simulated {b:,} "
                                 f"({100 * (a / b - 1) if b else float('inf'):+.0f}%)")
            elif abs(a - b) > hits:
                wrong.append(f"{r['policy']} {key.split('_')[0]} hits real {100 * a:.1f}% / simulated {100 * b:.1f}%")
    if not seen:
        return None
    if wrong:
        return "FAIL same work on both engines: " + "; ".join(wrong)
    return (f"PASS same work on both engines: recomputed tokens within {100 * tolerance:.0f}%, "
            f"hit rates within {100 * hits:.0f} points")


WORK = ("device_hit_rate", "host_hit_rate", "disk_hit_rate", "recomputed_tokens")


def same_work(a: dict, b: dict) -> bool:
    """Whether two policies did the same work on the simulator: the same hit rates on every tier
    and the same recomputed tokens (a figure a row lacks counts as equal). Their simulated
    speedup is then 1 by construction, and the real one is noise: nothing to compare."""
    return all(a.get(f"sim_{k}") == b.get(f"sim_{k}") for k in WORK)


def order(a: float, b: float, tie: float) -> int:
    """-1 (a < b), 1 (a > b), or 0 when they are within `tie` of the larger magnitude (tied)."""
    if abs(a - b) <= tie * max(abs(a), abs(b)):
        return 0
    return -1 if a < b else 1


def ranking(rows: list[dict], col: str, tie: float) -> str:
    """The policies by `col`, smallest first: 'a < b ~ c' ('~': tied with the one before).
    Equal figures are listed by name, for a stable line only."""
    ranked = sorted(rows, key=lambda r: (r[col], r["policy"]))
    out = ranked[0]["policy"] if ranked else ""
    for prev, r in zip(ranked, ranked[1:]):
        out += (" ~ " if order(prev[col], r[col], tie) == 0 else " < ") + r["policy"]
    return out


def disagreements(rows: list[dict], real: str, sim: str, tie: float) -> list[str]:
    """'a vs b' for each pair of policies the two columns order strictly and oppositely (sorted)."""
    wrong = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if order(a[real], b[real], tie) * order(a[sim], b[sim], tie) < 0:
                wrong.append(" vs ".join(sorted((a["policy"], b["policy"]))))
    return sorted(wrong)
