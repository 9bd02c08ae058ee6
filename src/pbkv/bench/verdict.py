"""One line per workload that says what a sweep showed: pbkv against LRU, against the best peer,
and how much of the oracle's gain it captured, in each memory regime (largest oracle gain first).

    hover: pbkv 1.12x LRU, 1.09x the best peer (kvflow), 33% of the oracle's gain (1.36x)
           [device+host, pressure 0.021, conc 64]; ...

With `--samples N` the speedups are of mean latencies, and the line gives pbkv's per-sample
range ("1.01x LRU (1.00-1.02 over 3 samples)").
"""

from __future__ import annotations

from pbkv.bench.report import regime_of
from pbkv.policy.registry import UnknownPolicy, needs_future, policy_class

SUBJECT = "pbkv"
REFERENCES = ("lru", "oracle")
MIN_ORACLE_GAIN = 0.02   # below this the regime leaves nothing to capture: no share is given


def verdicts(records: list[dict], subject: str = SUBJECT) -> list[str]:
    out = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        cells = _cells([r for r in records if r["workload"] == workload], subject)
        if cells:
            out.append(f"{workload}: " + "; ".join(_segment(c, subject) for c in cells))
    return out


def _cells(rows: list[dict], subject: str) -> list[dict]:
    """Per (regime, concurrency): the subject's, best peer's and oracle's speedups over LRU."""
    cells = []
    for key in dict.fromkeys(map(_cell_key, rows)):
        mine = [r for r in rows if _cell_key(r) == key]
        by = {r["policy"]: r.get("speedup_vs_lru", 1.0) for r in mine}
        if subject not in by:
            continue
        peers = {p: s for p, s in by.items() if _is_peer(p, subject)}
        best = max(peers, key=peers.get) if peers else None
        own = next(r for r in mine if r["policy"] == subject)
        spread = (own["speedup_vs_lru_min"], own["speedup_vs_lru_max"], own["samples"]) \
            if "speedup_vs_lru_min" in own else None
        cells.append({"row": mine[0], "subject": by[subject], "oracle": by.get("oracle"),
                      "peer": best, "peer_speedup": peers.get(best), "spread": spread})
    return sorted(cells, key=lambda c: -(c["oracle"] or 1.0))


def _cell_key(r: dict) -> tuple:
    """One cell per regime, concurrency and (simulated cluster) router and instance count: each
    router's records have their own LRU and oracle."""
    return regime_of(r), r["concurrency"], r.get("router"), r.get("instances")


def _is_peer(name: str, subject: str) -> bool:
    """A policy a user could pick instead of the subject: not a reference, not a variant of the
    subject (by name, or an out-of-tree subclass such as examples/ablation_policies.py's), and
    not a diagnostic that reads the replayed trace's future. A name the registry does not know
    (a record from another engine, e.g. "vllm") counts as a peer."""
    if name in REFERENCES or name == subject or name.startswith(subject + "-"):   # not "pbkv.policy.x:Y"
        return False
    try:
        cls, base = policy_class(name), policy_class(subject)
    except UnknownPolicy:
        return True
    return not issubclass(cls, base) and not needs_future(name)


def _segment(c: dict, subject: str) -> str:
    r = c["row"]
    text = f"{subject} {c['subject']:.2f}x LRU"
    if c["spread"] is not None:   # --samples: the mean's noise band, so a 1% lead is read as what it is
        lo, hi, n = c["spread"]
        text += f" ({lo:.2f}-{hi:.2f} over {n} samples)"
    if c["peer"] is not None:
        text += f", {c['subject'] / c['peer_speedup']:.2f}x the best peer ({c['peer']})"
    oracle = c["oracle"]
    if oracle is not None:
        if oracle - 1.0 >= MIN_ORACLE_GAIN:
            share = (c["subject"] - 1.0) / (oracle - 1.0)
            text += f", {100 * share:.0f}% of the oracle's gain ({oracle:.2f}x)"
        else:   # four decimals: at two, 1.0159 would print as a 2% gain beside words saying less
            text += f", the oracle gains under {100 * MIN_ORACLE_GAIN:.0f}% here ({oracle:.4f}x)"
    where = [_tiers_words(r)]
    if r.get("pressure"):
        where.append(f"pressure {r['pressure']:g}")
    where.append(f"conc {r['concurrency'] or 'open'}")
    if r.get("router") is not None:
        where.append(f"router {r['router']}, {r.get('instances')} instances")
    return f"{text} [{', '.join(where)}]"


def _tiers_words(r: dict) -> str:
    """The tiers a record ran with: the tier set it was given (--tiers), else its capacities
    (given by --device/--host/--disk-tokens or taken from the profile: the record cannot tell,
    so the sizes are named rather than "profile tiers", which a user who gave them would misread)."""
    if r.get("tiers"):
        return r["tiers"]
    if r.get("device_tokens") is None:   # a record without capacities (not one the sweep writes)
        return "tiers unknown"
    sizes = [f"{name} {r[f'{name}_tokens']:,}" for name in ("device", "host", "disk")
             if name == "device" or r.get(f"{name}_tokens")]
    return " + ".join(sizes) + " tokens"
