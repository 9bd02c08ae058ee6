"""Scoring a predictor on a trace (split one by task with `pbkv.trace.transform.split_by_task`).

`evaluate(predictor, trace)` predicts at every call position s of every workflow (history = agents
of calls 0..s, context of call s) and reports:
- `top1_k{k}`: argmax agent class vs the true agent of call s+k, over positions where call s+k
  exists (`n_k{k}` of them); a true agent the predictor does not know counts as UNK, so predicting
  UNK is right exactly then;
- `end_acc`: "the workflow ends after call s" predicted when survival[0] < 0.5, over all positions;
- `ece`: expected calibration error (15 equal-width bins) of the top-1 of the joint next event
  over agents + END: P(a) = s1 * p1[a], P(END) = 1 - s1;
- `nll_k1`: mean log loss of that joint next event (natural log);
- `us_per_call`: mean microseconds of one `predict` call over ~200 positions, one torch thread;
- `calls`: positions evaluated.
"""

from __future__ import annotations

import time

import numpy as np

from pbkv.predict.base import UNK, Predictor
from pbkv.trace import Trace

ECE_BINS = 15


def positions(trace: Trace) -> list[tuple[list[str], str | None, list[str]]]:
    """(history incl. call s, context of call s, agents of all calls of the workflow) per call."""
    out = []
    for calls in trace.workflows().values():
        agents = [c.agent for c in calls]
        out.extend((agents[:s + 1], c.context, agents) for s, c in enumerate(calls))
    return out


def ece(conf: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """sum over equal-width confidence bins of |bin| / N * |accuracy - mean confidence|."""
    if len(conf) == 0:
        return 0.0
    idx = np.minimum((conf * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.sum() / len(conf) * abs(correct[m].mean() - conf[m].mean())
    return float(total)


def time_predict(predictor: Predictor, items: list[tuple[list[str], str | None]], n: int = 200) -> float:
    """Mean microseconds of single `predict` calls on up to `n` items, with one torch thread."""
    import torch  # here, not at the top: scoring a Markov predictor needs no torch
    if not items:
        return 0.0
    step = max(1, len(items) // n)
    chosen = items[::step][:n]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for h, c in chosen[:10]:  # warm-up (caches, lazy init)
            predictor.predict(h, c)
        t0 = time.perf_counter()
        for h, c in chosen:
            predictor.predict(h, c)
        return (time.perf_counter() - t0) / len(chosen) * 1e6
    finally:
        torch.set_num_threads(threads)


def evaluate(predictor: Predictor, trace: Trace, timing: bool = True) -> dict:
    """The metrics of the module docstring as a dict of floats/ints (None where nothing to score)."""
    pos = positions(trace)
    items = [(h, c) for h, c, _ in pos]
    preds = predictor.predict_batch(items) if items else []
    known = set(predictor.agents)
    out: dict = {"calls": len(pos)}
    hits = np.zeros(predictor.horizon)
    counts = np.zeros(predictor.horizon, dtype=int)
    end_hits, conf, correct, nll = 0, [], [], []
    for (hist, _, agents), p in zip(pos, preds):
        s, n = len(hist) - 1, len(agents)
        for k in range(1, predictor.horizon + 1):
            if s + k < n:
                true = agents[s + k] if agents[s + k] in known else UNK
                counts[k - 1] += 1
                hits[k - 1] += p.top(k) == true
        ends = s + 1 >= n
        end_hits += (p.survival[0] < 0.5) == ends
        joint = p.joint(1)
        true_idx = len(joint) - 1 if ends else p.agents.index(agents[s + 1] if agents[s + 1] in known else UNK)
        best = int(np.argmax(joint))
        conf.append(joint[best])
        correct.append(best == true_idx)
        nll.append(-np.log(max(joint[true_idx], 1e-12)))
    for k in range(predictor.horizon):
        out[f"top1_k{k + 1}"] = float(hits[k] / counts[k]) if counts[k] else None
        out[f"n_k{k + 1}"] = int(counts[k])
    out["end_acc"] = float(end_hits / len(pos)) if pos else None
    out["ece"] = ece(np.array(conf), np.array(correct, dtype=float)) if pos else None
    out["nll_k1"] = float(np.mean(nll)) if pos else None
    out["us_per_call"] = time_predict(predictor, items) if timing else None
    return out


def unseen_note(known: set[str], data) -> str | None:
    """A note when calls of `data` have an agent outside `known` (the agents the predictors were
    trained on): those positions are scored as the unknown agent, so a wrong test file reads as
    0.000 everywhere unless told. None when every agent was seen."""
    unseen = [c.agent for c in data.calls if c.agent not in known]
    if not unseen:
        return None
    names = sorted(set(unseen))
    listed = ", ".join(names[:5]) + (f", ... ({len(names)} agents)" if len(names) > 5 else "")
    return (f"{len(unseen)} of {len(data.calls)} positions have an agent the predictors never saw ({listed}); "
            f"they score as an unknown agent")
