"""Memory regimes of a benchmark: how much device memory, and which tiers below it.

- pressure: device capacity as a fraction of the replay's distinct prompt tokens (the KV of
  every distinct prompt block once: what a cache would need to never recompute), so one
  fraction means comparable pressure on every workload; an explicit device capacity wins;
- tiers: "device" (no host or disk tier: vLLM's GPU prefix cache), "device+host" (a host tier
  of `HOST_RATIO` x the device, itself under pressure: SGLang HiCache-like), "device+host+disk"
  (plus a disk tier of `DISK_RATIO` x the device). Explicit host/disk capacities win for the
  tiers a regime has.
An explicit tier set runs exactly those tiers, whatever sizes the profile has: with
`--pressure profile` the ratios apply to the profile's device (a profile's own host_ratio and
disk_tokens are its default tiers, used only when no tier set is given). Sizes that contradict
the tier sets (`--host-tokens 0` with a host tier, or `--disk-tokens N` with no tier set that
has a disk) are refused (`check_tiers`) rather than silently dropped.
A regime's device capacity never drops below the largest single call (prompt + output), or
that call could never run; such a regime is clamped up (its record shows the real capacity, and
`clamp_note` words it for the terminal).
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_SETS = ("device", "device+host", "device+host+disk")
HOST_RATIO = 2
DISK_RATIO = 8


@dataclass(frozen=True)
class Regime:
    """One memory setting; None fields mean "from the profile" (the sweep's old behaviour)."""

    pressure: float | None = None
    tiers: str | None = None
    device_tokens: int | None = None
    host_tokens: int | None = None
    disk_tokens: int | None = None


def distinct_prompt_tokens(workload) -> int:
    """Tokens of the distinct prompt blocks of a workload (each chained block id once)."""
    size = workload.trace.block_size
    full: set[int] = set()             # blocks some call sends whole (every block but a call's last)
    last: dict[int, int] = {}          # a call's last block -> the most tokens any call sends in it
    for calls in workload.workflows:
        for c in calls:
            ids = c.hash_ids
            if ids:
                full.update(ids[:-1])
                tokens = c.input_length - size * (len(ids) - 1)
                if tokens > last.get(ids[-1], 0):
                    last[ids[-1]] = tokens
    # a block's tokens: the most any call sends in it (whole: `size`, unless a last block is longer)
    return sum(max(size, last.get(b, 0)) for b in full) + sum(t for b, t in last.items() if b not in full)


def largest_call(workload) -> int:
    return max(c.input_length + c.output_length for calls in workload.workflows for c in calls)


def parse_tiers(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    for n in names:
        if n not in TIER_SETS:
            raise ValueError(f"--tiers: unknown tier set {n!r}; expected {', '.join(TIER_SETS)} (comma-separated)")
    for i, n in enumerate(names):
        if n in names[:i]:   # it would run twice and count every sample twice
            raise ValueError(f"--tiers: {n} given twice")
    return names


def check_tiers(tiers: list[str], host_tokens: int | None, disk_tokens: int | None) -> None:
    """Raise ValueError when explicit --tiers and --host/--disk-tokens contradict each other: a
    tier set must run with exactly its tiers, so a tier it has cannot be sized 0 and a size given
    for a tier that none of them has would be silently ignored. No tier sets: nothing to check."""
    if not tiers:
        return
    for name, given in (("host", host_tokens), ("disk", disk_tokens)):
        having = [t for t in tiers if name in t]
        if given == 0 and having:
            raise ValueError(f"--tiers {having[0]} has a {name} tier but --{name}-tokens is 0; give "
                             f"--{name}-tokens > 0, leave it out (the ratio of the device), or drop that tier set")
        if given and not having:
            raise ValueError(f"--{name}-tokens {given}: none of --tiers {','.join(tiers)} has a {name} tier; "
                             f"add a tier set with one (e.g. device+host+disk) or leave --{name}-tokens out")


def parse_pressures(value: str) -> list[float]:
    out = []
    for v in value.split(","):
        try:
            p = float(v)
        except ValueError:
            raise ValueError(f"--pressure: expected fractions like 0.02,0.05,0.1, got {v!r}") from None
        if not 0 < p <= 1:
            raise ValueError(f"--pressure: a fraction of the distinct prompt tokens in (0, 1], got {v!r}")
        out.append(p)
    return out


def regimes(workload, pressures: list[float], tiers: list[str], device_tokens: int | None = None,
            host_tokens: int | None = None, disk_tokens: int | None = None) -> list[Regime]:
    """Every (pressure, tiers) combination for `workload`, pressures first (empty lists: one
    regime from the given or profile capacities)."""
    if not pressures and not tiers:
        return [Regime(None, None, device_tokens, host_tokens, disk_tokens)]
    if device_tokens is not None or not pressures:
        devices = [(None, device_tokens)]
    else:
        total, floor = distinct_prompt_tokens(workload), largest_call(workload)
        # two clamped pressures are one regime: run once (`clamp_note` says so)
        devices = [pressure_device(p, total, floor) for p in pressures]
    out = []
    for pressure, device in devices:
        for t in tiers or [None]:
            regime = _with_tiers(pressure, t, device, host_tokens, disk_tokens)
            if regime not in out:
                out.append(regime)
    return out


def pressure_device(pressure: float, total: int, floor: int) -> tuple[float, int]:
    """(pressure, device tokens) of a requested fraction of `total` distinct prompt tokens.
    Invariant: the device holds at least `floor` (the largest call, which could not run on less);
    a fraction below that is clamped up and reported as the pressure it really is."""
    device = int(pressure * total)
    return (pressure, device) if device >= floor else (round(floor / total, 4), floor)


def clamp_note(workload, pressures: list[float]) -> str | None:
    """The words for what `regimes` does to requested fractions below the largest call (None:
    none is): which ones, the pressure and device used instead, why, and that several clamped
    fractions became one regime. A run must not look like the one asked for when it is not."""
    total, floor = distinct_prompt_tokens(workload), largest_call(workload)
    low = [p for p in pressures if int(p * total) < floor]
    if not low:
        return None
    used, device = pressure_device(low[0], total, floor)
    asked = ", ".join(f"{p:g}" for p in low)
    note = (f"{workload.name}: --pressure {asked} {'is' if len(low) == 1 else 'are'} below the largest call ({floor:,} tokens of "
            f"{total:,} distinct prompt tokens), which could never run; ran at pressure {used:g} "
            f"(device {device:,} tokens) instead")
    if len(low) > 1:
        note += f"; the {len(low)} clamped fractions are one regime, run once"
    return note


def _with_tiers(pressure, tiers, device, host, disk) -> Regime:
    """A regime of tier set `tiers` (None: the profile's or given capacities as they are):
    exactly its tiers, given sizes first, else `HOST_RATIO` / `DISK_RATIO` x `device`."""
    if tiers is None:
        return Regime(pressure, None, device, host, disk)
    if device is None:  # ratios need a device size: left to the engine's defaults (the real engine's)
        return Regime(pressure, tiers, None, host if "host" in tiers else 0, disk if "disk" in tiers else 0)
    h = (host if host is not None else HOST_RATIO * device) if "host" in tiers else 0
    d = (disk if disk is not None else DISK_RATIO * device) if "disk" in tiers else 0
    return Regime(pressure, tiers, device, h, d)


AUTO_SHARES = (0.06, 0.15)  # device as a share of the running workflows' working set
# The default run: where each tier set shows differences between policies on the built-in
# workloads (measured: with a host tier of 2x the device, the oracle gains most when the device
# holds ~6% of the working set; with the device alone, at ~15%).
AUTO_REGIMES = (("device", 0.15), ("device+host", 0.06))


def workflow_tokens(workload) -> float:
    """Mean distinct prompt tokens of one workflow (its blocks once, shared prefixes included)."""
    size = workload.trace.block_size
    total = 0
    for calls in workload.workflows:
        seen: dict[int, int] = {}
        for c in calls:
            for block, tokens in zip(c.hash_ids, c.block_tokens(size)):
                seen[block] = tokens
        total += sum(seen.values())
    return total / max(1, len(workload.workflows))


def auto_regimes(workload, concurrency: int | None, tiers: list[str], host_tokens: int | None = None,
                 disk_tokens: int | None = None) -> list[Regime]:
    """Regimes chosen from the working set of `concurrency` running workflows (concurrency x one
    workflow's distinct prompt tokens), not from a GPU's size: `AUTO_REGIMES` when no tier set
    is given, else both `AUTO_SHARES` for each given tier set. Pressures are reported as usual
    (device / the replay's distinct prompt tokens)."""
    lanes = concurrency or 16
    total, floor = distinct_prompt_tokens(workload), largest_call(workload)
    working = lanes * workflow_tokens(workload)
    pairs = AUTO_REGIMES if not tiers else [(t, share) for share in AUTO_SHARES for t in tiers]
    if not tiers and host_tokens == 0:   # --host-tokens 0: no host tier, so no "device+host" regime
        pairs = [("device", share) for share in AUTO_SHARES]
    out = []
    for t, share in pairs:
        device = max(floor, int(min(1.0, share * working / total) * total))
        regime = _with_tiers(round(device / total, 4), t, device, host_tokens, disk_tokens)
        if regime not in out:   # both shares clamped to the largest call: one regime, run once
            out.append(regime)
    return out
