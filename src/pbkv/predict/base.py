"""What every predictor returns and the interface a cache policy relies on.

Invariants of a `Prediction` (checked by `check_prediction`, guaranteed by every predictor here):
- `agents` are the predictor's known agents followed by `UNK` ("<unk>") last;
- `probs` has shape [K, len(agents)], float64, no NaN, each row >= 0 and summing to 1: row k-1 is
  the distribution of the agent of call s+k given that the workflow makes call s+k;
- `survival` has shape [K], values in [0, 1], non-increasing: survival[k-1] = P(call s+k happens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

UNK = "<unk>"  # the class of every agent the predictor does not know (on input and output)
END = "<end>"  # the end of the workflow, as a target in training and evaluation (never in `agents`)
RESERVED_AGENTS = (UNK, END)   # class names of the predictor: no agent may be called so (check_agent_names)
MAX_HORIZON = 1024   # the longest prediction horizon a predictor may have (steps ahead; model.MODEL_RANGES)



def require_variant(predictor, variant: str, policy: str, source: str, hint: str = "") -> None:
    """Raise ValueError unless `predictor` (named `source` in the message) is the `variant` that
    `policy` reads: another variant would run, be reported as that policy's, and an online retrain
    (of `variant`) would silently replace it. The one check bench, perf, serve and the vLLM
    connector make; `hint` adds the caller's other way out."""
    if predictor.name != variant:
        raise ValueError(f"{source}: a {predictor.name} predictor (config.json variant {predictor.name!r}); "
                         f"policy {policy} needs a {variant} one (`pbkv train --variant {variant}`){hint}")

@dataclass
class Prediction:
    """K-step agent distributions (given alive) and survival for one running workflow."""

    agents: list[str]
    probs: np.ndarray
    survival: np.ndarray

    @property
    def horizon(self) -> int:
        return len(self.survival)

    def joint(self, k: int = 1) -> np.ndarray:
        """P(call s+k is made by agent a) for each class, then P(no call s+k) last; sums to 1."""
        s = float(self.survival[k - 1])
        return np.append(self.probs[k - 1] * s, 1.0 - s)

    def top(self, k: int = 1) -> str:
        """The most likely agent class of call s+k given the workflow is alive (ties: first)."""
        return self.agents[int(np.argmax(self.probs[k - 1]))]


@runtime_checkable
class Predictor(Protocol):
    """Predicts, for a running workflow, its next `horizon` agents and whether it goes on."""

    name: str
    horizon: int
    agents: list[str]  # known agents, without UNK

    def predict(self, history: list[str], context: str | None = None,
                hidden: np.ndarray | None = None) -> Prediction: ...

    def predict_batch(self, items: list[tuple[list[str], str | None]]) -> list[Prediction]: ...


def normalise_rows(p: np.ndarray) -> np.ndarray:
    """Rows scaled to sum 1; a row with no finite positive mass becomes uniform (never NaN)."""
    p = np.where(np.isfinite(p) & (p > 0), p, 0.0).astype(np.float64)
    sums = p.sum(axis=-1, keepdims=True)
    uniform = np.full_like(p, 1.0 / p.shape[-1])
    return np.where(sums > 0, p / np.where(sums > 0, sums, 1.0), uniform)


def monotone_survival(s: np.ndarray) -> np.ndarray:
    """Clip to [0, 1] (NaN -> 0) and force non-increasing with a running minimum."""
    s = np.nan_to_num(np.asarray(s, dtype=np.float64), nan=0.0)
    return np.minimum.accumulate(np.clip(s, 0.0, 1.0))


def check_prediction(p: Prediction, horizon: int | None = None, atol: float = 1e-6) -> None:
    """Raise AssertionError when `p` breaks an invariant of the module docstring."""
    k = horizon if horizon is not None else len(p.survival)
    assert p.agents and p.agents[-1] == UNK, f"agents must end with {UNK}: {p.agents}"
    assert p.probs.shape == (k, len(p.agents)) and p.probs.dtype == np.float64, p.probs.shape
    assert np.all(np.isfinite(p.probs)) and np.all(p.probs >= 0), "probs must be finite and >= 0"
    assert np.allclose(p.probs.sum(axis=1), 1.0, atol=atol), p.probs.sum(axis=1)
    s = p.survival
    assert s.shape == (k,) and np.all(np.isfinite(s)) and np.all((s >= 0) & (s <= 1)), s
    assert np.all(np.diff(s) <= atol), f"survival must be non-increasing: {s}"


def check_agent_names(traces) -> None:
    """Raise ValueError naming the trace file, workflow and step of the first call whose agent is
    one of `RESERVED_AGENTS`: the network would fold agent "<unk>" into its unknown class, the
    Markov baseline would hold two classes of one name, and a policy's next-event dict would count
    agent "<end>" and the workflow's end as one event."""
    for t in traces:
        for c in t.calls:
            if c.agent in RESERVED_AGENTS:
                where = f"{t.path}: " if getattr(t, "path", None) else ""
                raise ValueError(f"{where}workflow {c.workflow_id!r} step {c.step}: agent name {c.agent!r} is "
                                 f"reserved by the predictor ({', '.join(RESERVED_AGENTS)}); rename the agent")
