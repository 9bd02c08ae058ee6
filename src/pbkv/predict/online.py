"""Online learning: finished workflows join the history and the predictor is retrained.

- `add(agents, contexts)` records a finished workflow (kept in a bounded window, newest last);
- every `every` new workflows a retrain starts on the offline training set plus that window;
- `poll()` hands back the new predictor once it is ready, else None;
- `remember(workflows)` starts the window with workflows learned before (a restarted server's),
  `workflows()` is the window as (agent, context) pairs, for saving beside the predictor.

In background mode the retrain runs on a thread and serving never waits for it (`poll` only
checks whether it finished). In step mode (the simulator, which must be deterministic) the
retrain runs inside `poll` at the moment it is due; its wall time is counted in `seconds`,
not in simulated time, as it would run beside the engine on a spare core.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from pbkv.trace import Call, Trace, TraceMeta


class OnlineLearner:
    def __init__(self, base: list[Trace] | None = None, variant: str = "fused", horizon: int = 3,
                 every: int = 200, max_workflows: int = 2000, background: bool = False, seed: int = 0,
                 target_steps: int = 800):
        self.base = list(base or [])
        self.variant, self.horizon, self.every = variant, horizon, every
        self.window: deque[list[Call]] = deque(maxlen=max_workflows)
        self.background, self.seed, self.target_steps = background, seed, target_steps
        self.pending = 0
        self.added = 0
        self.retrains = 0
        self.seconds = 0.0
        self._ready = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, agents: list[str], contexts: list[str | None]) -> None:
        wid = f"online-{self.added}"
        self.added += 1
        self.window.append([Call(wid, step, agent, 1, 0, [0], context=ctx)
                            for step, (agent, ctx) in enumerate(zip(agents, contexts))])
        self.pending += 1

    def remember(self, workflows: list[list[tuple[str, str | None]]]) -> None:
        """Put earlier workflows in the window, oldest first. They are not pending: the
        predictor they come with has learned from them, so they only join the next retrain."""
        pending = self.pending
        for wf in workflows:
            OnlineLearner.add(self, [a for a, _ in wf], [c for _, c in wf])
        self.pending = pending

    def workflows(self) -> list[list[tuple[str, str | None]]]:
        """The window, oldest first, as (agent, context) per call."""
        return [[(c.agent, c.context) for c in wf] for wf in self.window]

    def poll(self):
        """A freshly trained predictor, or None. Starts a retrain when one is due."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None:
            return ready
        if self.pending >= self.every and (self._thread is None or not self._thread.is_alive()):
            self.pending = 0
            traces = self.base + [Trace(TraceMeta(), [c for wf in self.window for c in wf])]
            if self.background:
                self._thread = threading.Thread(target=self._train, args=(traces,), daemon=True)
                self._thread.start()
            else:
                self._train(traces)
                with self._lock:
                    ready, self._ready = self._ready, None
                return ready
        return None

    def _train(self, traces: list[Trace]) -> None:
        from pbkv.predict.train import train_predictor
        start = time.perf_counter()
        predictor = train_predictor(traces, variant=self.variant, horizon=self.horizon,
                                    seed=self.seed + self.retrains, target_steps=self.target_steps)
        with self._lock:
            self._ready = predictor
            self.retrains += 1
            self.seconds += time.perf_counter() - start
