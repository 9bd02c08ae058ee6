"""First-order Markov baseline: next agent from the current agent only, END absorbing.

States are the known agents, UNK and END. Row `a` of the transition matrix is the add-`alpha`
(Laplace) smoothed distribution of what followed agent `a` in training (another agent or END);
an unknown current agent (and the UNK state reached while propagating) uses the overall
next-agent distribution, an empty history the distribution of first agents. The k-step state
distribution is the current row times T^(k-1); survival[k-1] = 1 - its END mass, which never
increases because END is absorbing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pbkv import unique_json
from pbkv.predict.base import UNK, Prediction, check_agent_names, monotone_survival, normalise_rows
from pbkv.trace import Trace
from pbkv.trace.io import show_value

FORMAT = "pbkv-markov"
# The largest count or `alpha` accepted: a row's sum of counts + alpha overflows to infinity near
# 1e308 (NaN or flat rows), far above any count of transitions; below 2**53 a count is also an
# exact integer, as `to_dict` saves it.
MAX_COUNT = 1e15
ALPHA_EXPECTED = f"field 'alpha': expected a number from 0 to {MAX_COUNT:g}"


class MarkovPredictor:
    """Transition counts `counts[from, to]`: from = agents, UNK, START; to = agents, UNK, END.

    Invariants (checked here, so a hand-edited `markov.json` cannot slip through): every count
    and `alpha` is a number from 0 to `MAX_COUNT`, so each row is a distribution (its sum is
    finite)."""

    name = "markov"

    def __init__(self, agents: list[str], counts: np.ndarray, horizon: int = 3, alpha: float = 1.0):
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        n = len(agents)
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != (n + 2, n + 2):
            raise ValueError(f"counts must have shape {(n + 2, n + 2)}, got {counts.shape}")
        _check_counts(counts)
        if not 0 <= alpha <= MAX_COUNT:
            raise ValueError(f"{ALPHA_EXPECTED}, got {alpha!r}")
        self.agents, self.horizon, self.alpha = list(agents), horizon, float(alpha)
        self.counts = counts
        self.index = {a: i for i, a in enumerate(self.agents)}
        unk, start, end = n, n + 1, n + 1
        rows = counts + alpha
        # UNK: the overall next-agent distribution (counts after any agent, START excluded)
        rows[unk] = counts[:n + 1].sum(axis=0) + alpha
        self.start_row = normalise_rows(rows[start])
        trans = normalise_rows(rows[:n + 1])
        self.T = np.vstack([trans, np.eye(n + 2)[end]])  # END absorbing; square over agents, UNK, END

    @property
    def classes(self) -> list[str]:
        return self.agents + [UNK]

    def _first(self, history: list[str]) -> np.ndarray:
        if not history:
            return self.start_row
        return self.T[self.index.get(history[-1], len(self.agents))]

    def predict(self, history: list[str], context: str | None = None,
                hidden: np.ndarray | None = None) -> Prediction:
        """k-step distributions by propagating the chain; `context` and `hidden` are ignored."""
        v = self._first(list(history))
        steps = [v]
        for _ in range(self.horizon - 1):
            v = v @ self.T
            steps.append(v)
        states = np.array(steps)
        survival = monotone_survival(1.0 - states[:, -1])
        return Prediction(self.classes, normalise_rows(states[:, :-1]), survival)

    def predict_batch(self, items: list[tuple[list[str], str | None]]) -> list[Prediction]:
        return [self.predict(h, c) for h, c in items]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": 1, "agents": self.agents, "horizon": self.horizon,
                "alpha": self.alpha, "counts": self.counts.astype(int).tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "MarkovPredictor":
        """A predictor from `to_dict`'s JSON; a field of the wrong type or value is a ValueError
        naming the field and the value (`horizon` an integer, `alpha` a number, as saved)."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {show_value(d)}")
        if d.get("format") != FORMAT:
            raise ValueError(f"not a Markov predictor (format {d.get('format')!r}, expected {FORMAT!r})")
        horizon, alpha = d["horizon"], d["alpha"]
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
            raise ValueError(f"field 'horizon': expected an integer >= 1, got {horizon!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"{ALPHA_EXPECTED}, got {alpha!r}")
        return cls(check_agents(d["agents"]), np.array(d["counts"], dtype=np.float64), horizon, float(alpha))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MarkovPredictor":
        path = Path(path)
        if path.exists() and not path.is_file():   # a folder, or a FIFO that would block the read
            raise ValueError(f"{path}: not a file")
        try:
            return cls.from_dict(unique_json.loads(path.read_text()))   # a key written twice: refused
        except FileNotFoundError:
            raise ValueError(f"{path}: no such Markov model file") from None
        except RecursionError:
            raise ValueError(f"{path}: not a valid Markov model (JSON nested too deeply)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a valid Markov model ({e})") from None


def check_agents(agents, where: str = "agents") -> list[str]:
    """`agents` as saved (markov.json's and config.json's `agents`): a list of distinct strings,
    each one class. A string would be read as its letters, a repeated name as two classes, a
    number as a name no trace has: each loads and predicts wrongly without a word, so each is
    a ValueError naming the field and the value."""
    if not (isinstance(agents, list) and all(isinstance(a, str) for a in agents)):
        raise ValueError(f"field '{where}': expected a list of agent names (strings), got {show_value(agents)}")
    seen = set()
    for a in agents:
        if a in seen:
            raise ValueError(f"field '{where}': agent {show_value(a)} is listed twice")
        seen.add(a)
    return list(agents)


def _check_counts(counts: np.ndarray) -> None:
    """Raise ValueError naming the first count that is negative, above `MAX_COUNT` or NaN."""
    bad = np.argwhere(~((counts >= 0) & (counts <= MAX_COUNT)))
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"field 'counts': expected numbers from 0 to {MAX_COUNT:g}, got {float(counts[i, j])!r} "
                         f"at row {i}, column {j}")


def fit_markov(traces: Trace | list[Trace], horizon: int = 3, alpha: float = 1.0) -> MarkovPredictor:
    """Count START -> first agent, agent -> next agent and last agent -> END over every workflow."""
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    check_agent_names(traces)
    return fit_markov_seqs([[c.agent for c in calls] for t in traces for calls in t.workflows().values()],
                           horizon, alpha)


def fit_markov_seqs(seqs: list[list[str]], horizon: int = 3, alpha: float = 1.0) -> MarkovPredictor:
    """`fit_markov` on agent sequences (one per workflow, in step order)."""
    agents = sorted({a for s in seqs for a in s})
    idx = {a: i for i, a in enumerate(agents)}
    n = len(agents)
    counts = np.zeros((n + 2, n + 2))
    for s in seqs:
        if not s:
            continue
        counts[n + 1, idx[s[0]]] += 1
        for a, b in zip(s, s[1:]):
            counts[idx[a], idx[b]] += 1
        counts[idx[s[-1]], n + 1] += 1
    return MarkovPredictor(agents, counts, horizon, alpha)
