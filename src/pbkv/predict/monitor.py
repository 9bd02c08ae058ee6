"""Online check of prediction quality: how far to trust the predictor right now.

For every call the monitor compares the predicted next event of the workflow (its next agent,
or END) with what happened, and does the same for a first-order Markov baseline that it learns
online from the very calls it watches. Over a rolling window:

    trust = clip(1 + (acc_model - acc_baseline) / margin, 0, 1)

so a predictor at least as accurate as the online baseline is fully trusted, one `margin` worse
is not trusted at all, and trust moves smoothly in between. Until `min_samples` outcomes are
seen, the offline-trained predictor is trusted. Trust falls when the workload drifts away from
what the predictor was trained on (the online baseline adapts, the predictor does not) and
comes back when the predictor is right again (or is retrained).

The monitor also watches the lifecycle guardrail: `retired_reuse` is the share of recent calls
whose cached prefix ran through retired nodes (cache of ended workflows). When it is high,
ended workflows' cache is being reused by new ones (say, a chat whose turns arrive as separate
one-call workflows) and "retired first" would evict exactly what comes back.
"""

from __future__ import annotations

import math
from collections import deque

END = "<end>"


class OnlineMarkov:
    """Next-event counts (agent -> next agent or END), learned from the stream itself."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}
        self.overall: dict[str, int] = {}

    def distribution(self, current: str | None) -> dict[str, float]:
        row = self.counts.get(current) or self.overall
        total = sum(row.values())
        return {k: v / total for k, v in row.items()} if total else {}

    def observe(self, current: str, nxt: str) -> None:
        row = self.counts.setdefault(current, {})
        row[nxt] = row.get(nxt, 0) + 1
        self.overall[nxt] = self.overall.get(nxt, 0) + 1


def _top(dist: dict[str, float]) -> str | None:
    return max(sorted(dist), key=dist.get) if dist else None


class QualityMonitor:
    """Rolling accuracy and log-loss of the predictor against an online Markov baseline."""

    def __init__(self, window: int = 200, min_samples: int = 30, margin: float = 0.1,
                 retired_window: int = 200, retired_threshold: float = 0.1):
        self.window, self.min_samples, self.margin = window, min_samples, margin
        self.outcomes: deque[tuple[bool, bool, float, float]] = deque(maxlen=window)
        self.baseline = OnlineMarkov()
        self.retired: deque[bool] = deque(maxlen=retired_window)
        self.retired_threshold = retired_threshold
        self.total = 0
        self._means: dict[tuple[int, int], float] = {}
        # Running counts, kept on append (a reading is taken per ranked node: a scan of the
        # window each time was policy time). Invariant: hits[c] == sum(o[c] for o in outcomes)
        # for the two boolean columns c in (0, 1), and retired_hits == sum(retired); integers,
        # so the means read from them equal the scanned ones exactly.
        self.hits = [0, 0]
        self.retired_hits = 0

    def record(self, current: str, predicted: dict[str, float], actual: str) -> None:
        """`predicted`: the predictor's next-event distribution (agents and END) made at the
        call of `current`; `actual`: the next agent, or END."""
        base = self.baseline.distribution(current)
        outcome = (_top(predicted) == actual, _top(base) == actual,
                   -math.log(max(predicted.get(actual, 0.0), 1e-6)),
                   -math.log(max(base.get(actual, 0.0), 1e-6)))
        outcomes = self.outcomes
        if len(outcomes) == outcomes.maxlen:
            oldest = outcomes[0]                 # the append below pushes it out of the window
            self.hits[0] -= oldest[0]
            self.hits[1] -= oldest[1]
        outcomes.append(outcome)
        self.hits[0] += outcome[0]
        self.hits[1] += outcome[1]
        self.baseline.observe(current, actual)
        self.total += 1

    def record_match(self, retired_tokens: int) -> None:
        """A call arrived; `retired_tokens` of its cached prefix sit in retired nodes."""
        retired = self.retired
        if len(retired) == retired.maxlen:
            self.retired_hits -= retired[0]      # pushed out by the append below
        reused = retired_tokens > 0
        retired.append(reused)
        self.retired_hits += reused

    # ------------------------------------------------------------------ readings

    def _mean(self, column: int) -> float:
        """Mean of one column over the window: the boolean columns from the running `hits`
        (int / int, as the scan's sum of bools), the log-losses scanned (a running float sum
        would round differently) and memoised until the next outcome."""
        if column < 2:
            return self.hits[column] / max(1, len(self.outcomes))
        key = (self.total, column)
        if key not in self._means:
            if len(self._means) > 8:
                self._means.clear()
            self._means[key] = sum(o[column] for o in self.outcomes) / max(1, len(self.outcomes))
        return self._means[key]

    @property
    def accuracy(self) -> float:
        return self._mean(0)

    @property
    def baseline_accuracy(self) -> float:
        return self._mean(1)

    @property
    def log_loss(self) -> float:
        return self._mean(2)

    @property
    def baseline_log_loss(self) -> float:
        return self._mean(3)

    @property
    def trust(self) -> float:
        if len(self.outcomes) < self.min_samples:
            return 1.0
        gap = self.accuracy - self.baseline_accuracy
        return min(1.0, max(0.0, 1.0 + gap / self.margin))

    @property
    def retired_reuse(self) -> float:
        return self.retired_hits / len(self.retired) if self.retired else 0.0

    @property
    def retired_first(self) -> bool:
        """Is evicting ended workflows' private cache first still safe?"""
        return self.retired_reuse <= self.retired_threshold

    def summary(self) -> dict:
        """The readings, for a bench record; none of the prediction ones when nothing was
        predicted (a policy without a predictor, e.g. pbkv-retired)."""
        if self.total == 0:
            return {"retired_reuse": self.retired_reuse}
        return {"monitor_samples": self.total, "monitor_top1": self.accuracy,
                "monitor_baseline_top1": self.baseline_accuracy, "monitor_log_loss": self.log_loss,
                "monitor_baseline_log_loss": self.baseline_log_loss, "trust": self.trust,
                "retired_reuse": self.retired_reuse}
