"""Show and save a sweep: a table per workload, the JSON records, PNG plots per workload."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pbkv.files import CannotWrite, replaced_on_success


def _fmt(v, pct=False):
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def regime_of(r: dict) -> tuple:
    """The memory regime of a record: (tiers, pressure, device, host, disk tokens)."""
    return r.get("tiers"), r.get("pressure"), r.get("device_tokens"), r.get("host_tokens"), r.get("disk_tokens")


def regime_label(r: dict) -> str:
    tiers = f"{r['tiers']}, " if r.get("tiers") else ""
    pressure = f"pressure {r['pressure']:g}, " if r.get("pressure") else ""
    return f"{tiers}{pressure}KV tokens device {r['device_tokens']:,}, host {r['host_tokens']:,}, disk {r['disk_tokens']:,}"


def tables(records: list[dict]) -> list[Table]:
    """One table per workload and memory regime (rows: concurrency x policy)."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload]
        first = rows[0]
        if first.get("engine") in ("hf", "vllm"):
            out.append((hf_table if first["engine"] == "hf" else vllm_table)(workload, rows))
            continue
        for regime in dict.fromkeys((regime_of(r), r.get("instances")) for r in rows):
            cell = [r for r in rows if (regime_of(r), r.get("instances")) == regime]
            out.append((router_table if "router" in cell[0] else sim_table)(workload, cell))
    return out


def sim_table(workload: str, rows: list[dict]) -> Table:
    first = rows[0]
    samples = f"; means of {first['samples']} samples" if first.get("samples") else ""
    t = Table(title=f"{workload}: {first['workflows']} workflows; {regime_label(first)}{samples}",
              caption="pressure: device / distinct prompt tokens; lat/p99: workflow latency s; hit: % of prompt "
                      "tokens; recomp: M tokens recomputed; GB in: loaded to device; xLRU: LRU latency / policy's"
                      + ("; range: xLRU's lowest-highest over the samples" if samples else ""))
    for col in ("conc", "policy", "lat", "p99", "TTFT", "dev", "host", "disk", "recomp", "GB in", "xLRU") \
            + (("range",) if samples else ()):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["policy"], _fmt(r["mean_workflow_latency_s"]),
                  _fmt(r["p99_workflow_latency_s"]), _fmt(r["mean_ttft_s"]),
                  _fmt(r["device_hit_rate"], True), _fmt(r["host_hit_rate"], True),
                  _fmt(r["disk_hit_rate"], True), f"{r['recomputed_tokens'] / 1e6:.2f}",
                  f"{r['bytes_loaded'] / 1e9:.0f}", f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-",
                  *((_range(r),) if samples else ()))
    return t


def _range(r: dict) -> str:
    """`--samples`: the lowest and highest per-sample speedup over LRU."""
    if "speedup_vs_lru_min" not in r:
        return "-"
    return f"{r['speedup_vs_lru_min']:.2f}-{r['speedup_vs_lru_max']:.2f}"


def router_table(workload: str, rows: list[dict]) -> Table:
    """Several simulated instances: routers side by side (per instance capacities in the title)."""
    first = rows[0]
    t = Table(title=f"{workload}: {first['workflows']} workflows on {first['instances']} instances ({first['link']} "
                    f"links); KV tokens per instance device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                    f"disk {first['disk_tokens']:,}",
              caption="lat/p99: workflow latency s; wf/min: workflows finished per minute (throughput); hit: % "
                      "of prompt tokens; recomp: M tokens recomputed; GB moved: KV sent between instances; moves: "
                      "calls placed off their workflow's last instance; x rr / x prefix / x best: round-robin's / "
                      "prefix's / the fastest other router's latency over this router's (same policy and clients; "
                      "--samples: and its lowest-highest over the samples)")
    for col in ("conc", "router", "policy", "lat", "p99", "wf/min", "dev", "host", "disk", "recomp", "GB moved",
                "moves", "x rr", "x prefix", "x best"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["router"], r["policy"], _fmt(r["mean_workflow_latency_s"]),
                  _fmt(r["p99_workflow_latency_s"]), f"{60 * r['workflows'] / max(r['makespan_s'], 1e-9):.1f}",
                  _fmt(r["device_hit_rate"], True), _fmt(r["host_hit_rate"], True), _fmt(r["disk_hit_rate"], True),
                  f"{r['recomputed_tokens'] / 1e6:.2f}", f"{r['bytes_moved_between_instances'] / 1e9:.1f}",
                  str(r["workflow_moves"]), _gain(rows, r, "round-robin"), _gain(rows, r, "prefix"), _best(rows, r))
    return t


def _best(rows: list[dict], r: dict) -> str:
    """The fastest other router's mean latency over `r`'s (same policy and clients), with the
    per-sample range under `--samples`; "-" with one router."""
    others = [x["mean_workflow_latency_s"] for x in rows if x["router"] != r["router"]
              and x["policy"] == r["policy"] and x["concurrency"] == r["concurrency"]]
    if not others:
        return "-"
    text = f"{min(others) / max(r['mean_workflow_latency_s'], 1e-9):.3f}"
    if "vs_best_router_min" in r:
        text += f" ({r['vs_best_router_min']:.3f}-{r['vs_best_router_max']:.3f})"
    return text


def _gain(rows: list[dict], r: dict, router: str) -> str:
    """`router`'s mean workflow latency over `r`'s, same policy and concurrency ("-" if not run)."""
    ref = [x for x in rows if x["router"] == router and x["policy"] == r["policy"]
           and x["concurrency"] == r["concurrency"]]
    return f"{ref[0]['mean_workflow_latency_s'] / max(r['mean_workflow_latency_s'], 1e-9):.3f}" if ref else "-"


def hf_table(workload: str, rows: list[dict]) -> Table:
    """The real engine's runs: wall-clock latencies, hits per tier, what was computed and loaded."""
    first = rows[0]
    t = Table(title=f"{workload} on {first.get('model')} (scale {first.get('scale')}): {first['workflows']} workflows; "
                    f"KV tokens device {first['device_tokens']:,}, host {first['host_tokens']:,}, "
                    f"disk {first['disk_tokens']:,}",
              caption="wall-clock s (idle tool waits skipped); hit: % of prompt tokens; computed: prompt tokens "
                      "prefilled; in host/disk: tokens loaded back; wall: whole run; xLRU: LRU latency / policy's")
    for col in ("conc", "policy", "lat", "TTFT", "dev", "host", "disk", "computed", "in host", "in disk",
                "wall", "xLRU"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["policy"], _fmt(r["mean_workflow_latency_s"]),
                  _fmt(r["mean_ttft_s"]), _fmt(r["device_hit_rate"], True), _fmt(r["host_hit_rate"], True),
                  _fmt(r["disk_hit_rate"], True), f"{r['computed_tokens']:,}", f"{r['loaded_host_tokens']:,}",
                  f"{r['loaded_disk_tokens']:,}", _fmt(r["wall_seconds"]),
                  f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-")
    return t


def vllm_table(workload: str, rows: list[dict]) -> Table:
    """vLLM runs: alone ("vllm") and with pbkv's connector (the other policies)."""
    first = rows[0]
    t = Table(title=f"{workload} on vLLM, {first.get('model')} (scale {first.get('scale')}): {first['workflows']} "
                    f"workflows; KV tokens vLLM {first['device_tokens']:,}, connector RAM "
                    f"{max(r['host_tokens'] for r in rows):,}, disk {max(r['disk_tokens'] for r in rows):,}",
              caption="vllm: vLLM alone, others: vLLM + pbkv connector with that policy; tokens: prompt, computed "
                      "(prefilled), hits in vLLM's prefix cache / connector RAM / disk; lat: wall-clock s per "
                      "workflow; wall: whole replay; xvLLM: vLLM-alone latency / setup's")
    for col in ("conc", "policy", "calls", "prompt", "computed", "vLLM hit", "RAM hit", "disk hit", "lat", "wall",
                "xvLLM"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["concurrency"] or "open"), r["policy"], str(r["calls"]), f"{r['prompt_tokens']:,}",
                  f"{r['computed_tokens']:,}", f"{r['vllm_hit_tokens']:,}", f"{r['ram_hit_tokens']:,}",
                  f"{r['disk_hit_tokens']:,}", _fmt(r["mean_workflow_latency_s"]), _fmt(r["wall_seconds"]),
                  f"{r['speedup_vs_lru']:.2f}" if "speedup_vs_lru" in r else "-")
    return t


def print_tables(records: list[dict], console: Console | None = None) -> None:
    console = console or Console()
    for t in tables(records):
        print_whole(console, t)


def print_whole(console: Console, table: Table) -> None:
    """Print `table` uncut. A terminal keeps its width (rich fits the table to it); a file or a
    pipe (a CI log, `| tee`) gets the table's natural width: at the console's fixed 110 columns a
    router table (15 columns) came out as `co…` and `1.025 (0.998-1.…`."""
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    width = console.width
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


def write_json(data, path: Path, finite: bool = False) -> Path:
    """Write `data` as indented JSON (numpy scalars as floats); the file appears whole or not at
    all (a killed run leaves no half JSON). `finite` (bench.json): a NaN or infinity is a
    ValueError naming the file and the figure, not a `NaN` that strict JSON readers reject."""
    if finite and (where := _non_finite(data)) is not None:
        raise ValueError(f"{path}: not written: {where[0]} is {where[1]}, not a finite number "
                         f"(JSON has no NaN or infinity)")
    with _naming(path), replaced_on_success(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return path


def _non_finite(data, where: str = "") -> tuple[str, float] | None:
    """(path such as `[3].mean_workflow_latency_s`, value) of the first NaN or infinity in `data`."""
    if isinstance(data, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(data))
    else:
        try:
            return None if math.isfinite(data) else (where or "the value", float(data))
        except (TypeError, OverflowError):  # a string, None; an int too large for a float is exact JSON
            return None
    return next(filter(None, (_non_finite(v, w) for w, v in items)), None)


@contextmanager
def _naming(path: Path):
    """An OSError writing `path` that names no file (a full disk, `[Errno 27] File too large`)
    is raised again naming it: `pbkv bench`'s one error line then says which file failed."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or isinstance(e, CannotWrite):   # it names its file already
            raise
        raise CannotWrite(f"{path}: cannot write ({e.strerror or e})") from e


def _line_of(r: dict) -> tuple:
    """What a plot line holds fixed: policy, router and instance count. Records differing in any
    of them are unlike runs (an 8-instance run is no point on a 2-instance curve), so they never
    share a line; the x axis is the one thing that varies along it."""
    return r["policy"], r.get("router"), r.get("instances")


def _lines(rows: list[dict], x: str) -> dict[str, list[dict]]:
    """`rows` split into plot lines (`_line_of`), each sorted by `x`, keyed by its legend label:
    the policy, the router when one ran, and the instance count when several counts are plotted."""
    counts = {r.get("instances") for r in rows}
    out: dict[str, list[dict]] = {}
    for key in dict.fromkeys(map(_line_of, rows)):
        policy, router, instances = key
        label = policy if router is None else f"{policy} / {router}"
        if len(counts) > 1:
            label += f" x{instances}"
        out[label] = sorted((r for r in rows if _line_of(r) == key), key=lambda r: r[x])
    return out


def write_plots(records: list[dict], out: Path) -> list[Path]:
    """Per workload: speedup over LRU and device hit rate against concurrency, one line per
    policy, router and instance count (`_lines`; the runs `_first_regime` picks); with several
    device capacities also `WORKLOAD-regimes.png`: speedup and the miss-ratio curve (device hit
    rate against device capacity), one column per tier set, one line per policy, router and
    instance count, at the highest concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload and r["concurrency"] is not None]
        if not rows:
            continue
        paths.append(_concurrency_plot(plt, workload, _first_regime(rows), out))
        if len({r["device_tokens"] for r in rows}) > 1:
            paths.append(_regimes_plot(plt, workload, rows, out))
    return paths


def earlier_plots(out: Path) -> list[Path]:
    """The plots an earlier bench run wrote into `out`, by the workloads of its `out/bench.json`
    (read before this run replaces it): `WORKLOAD.png` and `WORKLOAD-regimes.png` that exist.
    Nothing when there is no readable bench.json: no other file is taken for bench's."""
    try:
        records = json.loads((out / "bench.json").read_text())
        names = dict.fromkeys(str(r["workload"]) for r in records)
    except (OSError, ValueError, TypeError, KeyError):
        return []
    paths = [out / f"{w}{suffix}.png" for w in names if w and "/" not in w and w not in (".", "..")
             for suffix in ("", "-regimes")]
    return [p for p in paths if p.is_file()]


def remove_plots(paths: list[Path], keep: list[Path]) -> list[Path]:
    """Remove `paths` (an earlier run's plots, `earlier_plots`) that this run did not write again
    (`keep`): they would describe figures bench.json no longer holds. Returns those removed."""
    kept = {p.resolve() for p in keep}
    removed = []
    for p in paths:
        if p.resolve() not in kept:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _first_regime(rows: list[dict]) -> list[dict]:
    """The runs of the concurrency plot: at each concurrency, those of its first regime with the
    first run's tiers. An explicit regime is the same at every concurrency; `--pressure auto`
    sizes the device from each concurrency's working set, so there the capacity varies along
    the line (the plot says so) instead of each line having one point."""
    tiers = rows[0].get("tiers")
    kept = []
    for concurrency in dict.fromkeys(r["concurrency"] for r in rows):
        mine = [r for r in rows if r["concurrency"] == concurrency and r.get("tiers") == tiers]
        kept += [r for r in mine if regime_of(r) == regime_of(mine[0])] if mine else []
    return kept


def _concurrency_plot(plt, workload: str, rows: list[dict], out: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = sorted({r["device_tokens"] for r in rows})
    if len(sizes) > 1:
        fig.suptitle(f"{rows[0].get('tiers') or 'profile tiers'}, device KV tokens sized per concurrency: "
                     f"{sizes[0]:,} to {sizes[-1]:,}", fontsize="small")
    for label, pts in _lines(rows, "concurrency").items():
        xs = [r["concurrency"] for r in pts]
        ax1.plot(xs, [r.get("speedup_vs_lru", 1.0) for r in pts], marker="o", label=label)
        ax2.plot(xs, [100 * r["device_hit_rate"] for r in pts], marker="o", label=label)
    ax1.set(title=f"{workload}: speedup over LRU", xlabel="concurrent workflows",
            ylabel="LRU mean workflow latency / policy's")
    ax2.set(title=f"{workload}: device hit rate", xlabel="concurrent workflows", ylabel="% of prompt tokens")
    return _save(plt, fig, (ax1, ax2), out / f"{workload}.png")


def _tiers_below(r: dict) -> str:
    """A column of runs without a tier set, named by the tiers below the device they ran with
    (given by --host/--disk-tokens or the profile's: the record cannot tell which)."""
    sizes = [f"{name} {r[f'{name}_tokens']:,}" for name in ("host", "disk") if r.get(f"{name}_tokens")]
    return " + ".join(["device"] + sizes)


def _regimes_plot(plt, workload: str, rows: list[dict], out: Path) -> Path:
    top = max(r["concurrency"] for r in rows)
    rows = [r for r in rows if r["concurrency"] == top]
    tier_sets = list(dict.fromkeys(r.get("tiers") for r in rows))
    fig, axes = plt.subplots(2, len(tier_sets), figsize=(5 * len(tier_sets), 8), squeeze=False)
    for col, tiers in enumerate(tier_sets):
        mine = sorted((r for r in rows if r.get("tiers") == tiers), key=lambda r: r["device_tokens"])
        for label, pts in _lines(mine, "device_tokens").items():
            xs = [r["device_tokens"] for r in pts]
            axes[0][col].plot(xs, [r.get("speedup_vs_lru", 1.0) for r in pts], marker="o", label=label)
            axes[1][col].plot(xs, [100 * r["device_hit_rate"] for r in pts], marker="o", label=label)
        name = tiers or _tiers_below(mine[0])
        axes[0][col].set(title=f"{workload}, {name}: speedup over LRU (conc {top})", xlabel="device KV tokens",
                         ylabel="LRU mean workflow latency / policy's")
        axes[1][col].set(title=f"{workload}, {name}: miss-ratio curve", xlabel="device KV tokens",
                         ylabel="device hit rate, % of prompt tokens")
    return _save(plt, fig, axes.flatten(), out / f"{workload}-regimes.png")


def _save(plt, fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with _naming(path):
            fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
