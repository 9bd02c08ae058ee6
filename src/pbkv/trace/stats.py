"""Per-workload statistics of a trace, as defined in docs/trace-format.md ("Statistics").

`trace_stats(trace, heldout=None)` computes, for one `Trace`:
- workflows, calls, distinct agents, calls per agent (count desc, then name), consecutive agent
  pairs inside workflows;
- median / p90 / max of calls per workflow, `input_length` and `output_length`;
- prefix reuse under an infinite cache, `global` and `within workflow`;
- H(next agent | current agent) in bits, without and with end-of-workflow as a next value;
- with a `heldout` trace: Markov top-1 next-agent accuracy (fit on `trace`, scored on `heldout`),
  its end-of-workflow variant, and the `same` / `top` baselines.
A trace whose calls name several workloads is reported as one, headed by its path and every
workload's name (`workload` None, `workloads` lists them).
`format_stats(stats)` renders that dict as plain-text lines, one '- ' line per figure.
"""

from __future__ import annotations

import math
from collections import Counter

from pbkv.trace.call import Call, Trace


class _End:
    """The end-of-workflow value of the +END variants. Not a string: any non-empty string is a valid
    agent name, so a string marker ("<END>") made an agent of that name end its workflows, and
    renaming an agent changed the figures."""

    def __repr__(self) -> str:
        return "END"


END = _End()


def tie_order(agent) -> tuple[str, int]:
    """Where `agent` (a name or END) goes when counts tie: by name, END as if named "<END>" (before
    letters) and before an agent really named so."""
    return ("<END>", 0) if agent is END else (agent, 1)


def percentile_summary(values: list[float]) -> dict | None:
    """median (mean of the two middle values when n is even), nearest-rank p90 (the value at
    sorted position ceil(0.9 n)), max. None for no values; integral results are ints."""
    if not values:
        return None
    v = sorted(values)
    n = len(v)
    mid = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    p90 = v[max(1, math.ceil(0.9 * n)) - 1]
    return {k: _num(x) for k, x in (("median", mid), ("p90", p90), ("max", v[-1]))}


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(float(x), 3)


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def ordered_workflows(trace: Trace) -> list[list[Call]]:
    """Workflows sorted by workflow_id, each in step order (the 'file order' of the reuse figures)."""
    wfs = trace.workflows()
    return [wfs[k] for k in sorted(wfs)]


def agent_sequences(trace: Trace) -> list[list[str]]:
    """The agent of each call, per workflow, in step order."""
    return [[c.agent for c in calls] for calls in ordered_workflows(trace)]


def transitions(seqs: list[list[str]], end: bool) -> list[tuple[str, str]]:
    """Consecutive (current, next) agent pairs inside workflows; with `end`, also (last, END)
    per workflow, so there is one transition per call."""
    out = [p for s in seqs for p in zip(s, s[1:])]
    if end:
        out += [(s[-1], END) for s in seqs if s]
    return out


def prefix_reuse(workflows: list[list[Call]], within: bool) -> float | None:
    """Fraction of all prompt blocks whose hash id already appeared in an earlier call, calls
    taken in the given order. One infinite cache for all (`within=False`), or emptied at each
    workflow start (`within=True`). None when there are no blocks."""
    seen: set[int] = set()
    hits = total = 0
    for calls in workflows:
        if within:
            seen = set()
        for c in calls:
            hits += sum(1 for h in c.hash_ids if h in seen)
            total += len(c.hash_ids)
            seen.update(c.hash_ids)
    return hits / total if total else None


def conditional_entropy(pairs: list[tuple[str, str]]) -> float | None:
    """H(next | current) in bits = -sum over (c, n) of p(c, n) log2 p(n | c), with the empirical
    distribution of `pairs`. None when there are no pairs."""
    if not pairs:
        return None
    joint = Counter(pairs)
    cur = Counter(c for c, _ in pairs)
    h = -sum(k / len(pairs) * math.log2(k / cur[c]) for (c, _), k in joint.items())
    return max(0.0, h)  # no -0.0


def most_frequent(counts: Counter) -> str:
    """The value with the highest count, ties broken by smallest name (`tie_order`)."""
    return min(counts, key=lambda a: (-counts[a], tie_order(a)))


class MarkovPredictor:
    """First-order next-agent predictor: most frequent successor of the current agent (ties by
    name); a current agent with no successor in the fit pairs gets the most frequent successor
    overall."""

    def __init__(self, pairs: list[tuple[str, str]]):
        if not pairs:
            raise ValueError("cannot fit a Markov predictor on no pairs")
        succ: dict[str, Counter] = {}
        for c, n in pairs:
            succ.setdefault(c, Counter())[n] += 1
        self.table = {c: most_frequent(cnt) for c, cnt in succ.items()}
        self.fallback = most_frequent(Counter(n for _, n in pairs))

    def predict(self, agent: str) -> str:
        return self.table.get(agent, self.fallback)


def _accuracy(preds: list[str], pairs: list[tuple[str, str]]) -> float | None:
    if not pairs:
        return None
    return sum(p == n for p, (_, n) in zip(preds, pairs)) / len(pairs)


def markov_stats(fit: Trace, test: Trace) -> dict:
    """Top-1 accuracy of `MarkovPredictor` fit on `fit`, scored on `test`'s consecutive pairs
    (`top1`, over `pairs`, `unseen` of them with a current agent that has no successor in `fit`),
    and with END as a next value, scored over every call of `test` (`top1_end`, over `calls`).
    Baselines on the same pairs: `same` = predict the current agent, `top` = the most frequent
    next agent in `fit`. Accuracies are None when `fit` has no pairs or there is nothing to score."""
    fs, ts = agent_sequences(fit), agent_sequences(test)
    fit_pairs, test_pairs = transitions(fs, False), transitions(ts, False)
    test_end = transitions(ts, True)
    out = {"pairs": len(test_pairs), "calls": len(test_end), "unseen": None, "top1": None,
           "top1_end": None, "same": None, "top": None}
    if not fit_pairs:
        return out
    m, m_end = MarkovPredictor(fit_pairs), MarkovPredictor(transitions(fs, True))
    top = m.fallback
    out["unseen"] = sum(1 for c, _ in test_pairs if c not in m.table)
    out["top1"] = _r3(_accuracy([m.predict(c) for c, _ in test_pairs], test_pairs))
    out["top1_end"] = _r3(_accuracy([m_end.predict(c) for c, _ in test_end], test_end))
    out["same"] = _r3(_accuracy([c for c, _ in test_pairs], test_pairs))
    out["top"] = _r3(_accuracy([top] * len(test_pairs), test_pairs))
    return out


def workload_names(trace: Trace) -> list[str]:
    """The distinct `workload`s the calls name, sorted."""
    return sorted({c.workload for c in trace.calls if c.workload})


def workload_name(trace: Trace) -> str | None:
    """The one workload of the trace: the `workload` of the metadata line, else the one the calls
    name. None when the calls name more than one (the figures then mix workloads, and no single
    name may head them) or none."""
    names = workload_names(trace)
    if len(names) > 1:
        return None
    name = trace.meta.extra.get("workload")
    return name if isinstance(name, str) else next(iter(names), None)


def trace_stats(trace: Trace, heldout: Trace | None = None) -> dict:
    """All statistics of `trace` as a JSON-serialisable dict (floats rounded to 3 decimals).
    `markov` is None without `heldout`, else the dict of `markov_stats(trace, heldout)`."""
    wfs = ordered_workflows(trace)
    seqs = [[c.agent for c in calls] for calls in wfs]
    counts = Counter(c.agent for c in trace.calls)
    return {
        "workload": workload_name(trace),
        "workloads": workload_names(trace),
        "path": trace.path,
        "block_size": trace.block_size,
        "workflows": len(wfs),
        "calls": len(trace.calls),
        "agents": len(counts),
        "agent_calls": [[a, counts[a]] for a in sorted(counts, key=lambda a: (-counts[a], a))],
        "pairs": len(transitions(seqs, False)),
        "calls_per_workflow": percentile_summary([len(w) for w in wfs]),
        "input_length": percentile_summary([c.input_length for c in trace.calls]),
        "output_length": percentile_summary([c.output_length for c in trace.calls]),
        "reuse_global": _r3(prefix_reuse(wfs, within=False)),
        "reuse_within_workflow": _r3(prefix_reuse(wfs, within=True)),
        "h_next": _r3(conditional_entropy(transitions(seqs, False))),
        "h_next_end": _r3(conditional_entropy(transitions(seqs, True))),
        "markov": None if heldout is None else markov_stats(trace, heldout),
    }


def _f3(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _acc(x: float | None) -> str:
    """Accuracy as printed: 3 decimals without trailing zeros (1.000 -> 1)."""
    return "n/a" if x is None else f"{x:.3f}".rstrip("0").rstrip(".")


def _summary(s: dict | None) -> str:
    return "n/a" if s is None else f"{s['median']} / {s['p90']} / {s['max']}"


def _markov_line(m: dict) -> str:
    return (f"- Markov top-1 next-agent accuracy, fit on this trace, tested on heldout: "
            f"{_acc(m['top1'])} over {m['pairs']} pairs ({m['unseen'] if m['unseen'] is not None else 'n/a'}"
            f" with a current agent unseen in the fit trace); with end-of-workflow: "
            f"{_acc(m['top1_end'])} over {m['calls']}; baselines same-agent {_acc(m['same'])}, "
            f"most-frequent {_acc(m['top'])}")


def _heading(stats: dict) -> str:
    """'## NAME': the workload, else the path; a trace mixing workloads names them all."""
    head = f"## {stats['workload'] or stats['path'] or 'trace'}"
    mixed = stats.get("workloads") or []
    return head + (f" (workloads: {', '.join(mixed)})" if len(mixed) > 1 else "")


def format_stats(stats: dict) -> str:
    """Plain-text report of a `trace_stats` dict, one '- ' line per figure."""
    agents = ", ".join(f"{a} ({n})" for a, n in stats["agent_calls"])
    lines = [
        _heading(stats),
        f"- workflows {stats['workflows']}, calls {stats['calls']}, "
        f"consecutive agent pairs {stats['pairs']}",
        f"- agents (calls): {agents}",
        f"- calls per workflow median/p90/max: {_summary(stats['calls_per_workflow'])}",
        f"- input_length median/p90/max: {_summary(stats['input_length'])}",
        f"- output_length median/p90/max: {_summary(stats['output_length'])}",
        f"- prefix reuse under an infinite cache: global {_f3(stats['reuse_global'])}, "
        f"within workflow {_f3(stats['reuse_within_workflow'])}",
        f"- H(next agent | current agent): {_f3(stats['h_next'])} bits "
        f"(with end-of-workflow as a value: {_f3(stats['h_next_end'])} bits)",
    ]
    if stats.get("markov") is not None:
        lines.append(_markov_line(stats["markov"]))
    return "\n".join(lines)
