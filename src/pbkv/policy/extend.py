"""Predictions past the predictor's horizon, by the agent chain learned online.

The predictor gives, for the next K calls of a workflow, each call's agent distribution P_k and
the probability s_k that the call happens. A node whose agents are not predicted within those
K calls was ranked by LRU among the "dead", yet in a loop (retriever -> summarizer -> verifier
-> retriever ...) the same agents come back a call or two later: with a perfect predictor and
K = 3, the host still dropped nodes read again within 15 s while it held nodes never read
again (issue 11, hover with a host tier). Past step K the walk continues on the first-order
chain of next events (agent -> next agent or END) that the quality monitor learns online from
the same calls:

    m_{k+1}[c] = sum_b s_k P_k[b] T(b -> c),   s_{k+1} = sum_c m_{k+1}[c],   P_{k+1} = m_{k+1} / s_{k+1}

stopping at `steps` calls or once s_k < MIN_SURVIVAL. An agent the chain has never seen leave
ends the walk's mass there (absorbed). Invariant: the first K rows are the predictor's, so
everything learned offline keeps deciding the near future; survival never increases.
"""

from __future__ import annotations

from pbkv.predict.monitor import END, OnlineMarkov

MIN_SURVIVAL = 0.01
REBUILD_EVERY = 32   # observations between rebuilds of the normalised chain (policy time)


class Chain:
    """The monitor's online next-event counts as normalised rows, rebuilt now and then."""

    def __init__(self, markov: OnlineMarkov):
        self.markov = markov
        self.rows: dict[str, dict[str, float]] = {}
        self.seen = -1

    def get(self) -> dict[str, dict[str, float]]:
        total = sum(self.markov.overall.values())
        if self.seen < 0 or total - self.seen >= REBUILD_EVERY:
            self.seen = total
            self.rows = {a: {b: c / sum(row.values()) for b, c in row.items()}
                         for a, row in self.markov.counts.items() if row}
        return self.rows


def beyond(probs, survival, classes: list[str], chain: dict[str, dict[str, float]], steps: int):
    """(probs, survival) extended to at most `steps` calls; rows are lists over `classes`.
    `chain[a]` is a's next-event distribution (agents and END), missing rows absorb."""
    rows = [[float(x) for x in row] for row in probs]
    surv = [float(s) for s in survival]
    k = min(len(rows), len(surv))
    rows, surv = rows[:k], surv[:k]
    index = {name: i for i, name in enumerate(classes)}
    unknown = len(classes) - 1
    while k and len(rows) < steps and surv[-1] >= MIN_SURVIVAL:
        last, s = rows[-1], surv[-1]
        mass = [0.0] * len(classes)
        for b, pb in enumerate(last):
            if pb <= 0.0:
                continue
            for c, t in chain.get(classes[b], {}).items():
                j = index.get(c)
                if j is None and c != END:
                    j = unknown
                if j is not None:
                    mass[j] += s * pb * t
        total = sum(mass)
        if total <= 0.0:
            break
        rows.append([m / total for m in mass])
        surv.append(min(total, s))
    return rows, surv
