"""The policy a server runs, its predictor, and learning from the traffic it serves.

- `--predictor DIR` with a predictor saved by `pbkv train` (or by an earlier `pbkv serve`): it is
  loaded; without one (or without the option) a policy that predicts starts from an empty Markov
  chain, which predicts nothing useful, so the quality monitor's trust falls and the order is
  LRU's until the first retrain;
- online learning (on by default for predicting policies): the policy hands every ended workflow
  to `TrafficLearner` (retrains in a child process, serving never waits) and swaps in the new
  predictor when it is ready (`PBKVPolicy._learn`);
- on shutdown the newest neural predictor is saved back to `--predictor` (after a last retrain
  on workflows not yet learned from), each file replaced atomically.
Policies that read a trace's future (the oracle) cannot serve: a server has no future.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from pbkv.policy import PolicyContext
from pbkv.policy.registry import make_policy, needed_predictor, needs_future
from pbkv.predict.online import OnlineLearner
from pbkv.serve.workflows import DEFAULT_AGENT

log = logging.getLogger("pbkv.serve")
MIN_FINAL_TRAIN = 10   # ended workflows needed for the retrain at shutdown
DEFAULT_NICE = 10      # the retrain process yields the CPU to the server (0: an equal share)


@dataclass
class PolicySetup:
    policy: object
    learner: object | None
    variant: str | None
    model_dir: Path | None
    loaded: bool


class TrafficLearner(OnlineLearner):
    """`OnlineLearner` for served traffic.

    - Learns only from workflows that named their agents: a call without hints is a one-call run
      of the default agent, which says nothing about who comes next.
    - Background retrains run in one child process (spawned once), not on a thread of the server:
      training is Python-heavy, and a thread fights the engine for the GIL (a niced thread never
      finished a retrain within a 50 s saturated run). The child saves the predictor to a
      temporary folder and this process loads it.
    - `nice` (default 10) lets serving come first: on a saturated 2-core machine a retrain then
      waits for a lull. At 0 it takes an equal CPU share: measured on 2 cores, 64 clients, 3
      retrains in 46 s but 28 instead of 38 calls/s while they ran.
    """

    skipped = 0
    nice = DEFAULT_NICE
    _pool = None

    def add(self, agents: list[str], contexts: list[str | None]) -> None:
        if all(a == DEFAULT_AGENT for a in agents):
            self.skipped += 1
            return
        super().add(agents, contexts)

    def _train(self, traces) -> None:
        if not self.background:
            return super()._train(traces)
        from pbkv.predict.predictor import load_predictor
        start = time.perf_counter()
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_child_init,
                                             initargs=(self.nice,))
        with tempfile.TemporaryDirectory(prefix="pbkv-learn-") as folder:
            try:
                self._pool.submit(_train_in_child, traces, self.variant, self.horizon, self.seed + self.retrains,
                                  self.target_steps, folder).result()
            except BrokenProcessPool:  # stopped by `close(kill=True)` at shutdown
                return
            predictor = load_predictor(folder)
        with self._lock:
            self._ready = predictor
            self.retrains += 1
            self.seconds += time.perf_counter() - start

    def finish(self, final_train: bool = True):
        """At shutdown: wait for a retrain in progress, then (`final_train`) retrain here on the
        workflows it has not seen, when there are enough. The newest predictor, or None."""
        if not final_train:  # nothing will be saved: stop a retrain in progress, do not wait for it
            self.close(kill=True)
            return None
        if self._thread is not None:
            self._thread.join()
        self.close()
        with self._lock:
            newest, self._ready = self._ready, None
        if final_train and self.pending and len(self.window) >= MIN_FINAL_TRAIN:
            self.background, self.every = False, 1
            newest = self.poll() or newest
        return newest

    def close(self, kill: bool = False) -> None:
        if self._pool is not None:
            if kill:
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    proc.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)  # quick once killed; frees its locks
            self._pool = None


def _child_init(nice: int) -> None:
    try:
        os.nice(nice)
    except OSError:
        pass


def _train_in_child(traces, variant: str, horizon: int, seed: int, steps: int, folder: str) -> str:
    from pbkv.predict.predictor import save_predictor
    from pbkv.predict.train import train_predictor
    save_predictor(train_predictor(traces, variant=variant, horizon=horizon, seed=seed, target_steps=steps), folder)
    return folder


def empty_markov(horizon: int):
    from pbkv.predict.markov import MarkovPredictor
    return MarkovPredictor([], np.zeros((2, 2)), horizon)


def build_policy(name: str, block_size: int, model_dir: str | Path | None = None, online: bool = True,
                 learn_every: int = 50, horizon: int = 3, learn_steps: int = 300,
                 learn_nice: int = DEFAULT_NICE) -> PolicySetup:
    """Raises ValueError (unknown policy, a future-reading policy, an unreadable predictor)."""
    if needs_future(name):
        raise ValueError(f"policy {name!r} reads the future of a replayed trace; a server has none "
                         f"(use lru, kvflow or pbkv)")
    variant = needed_predictor(name)
    model_dir = Path(model_dir) if model_dir else None
    predictors, loaded = {}, False
    if variant is not None:
        if model_dir is not None and (model_dir / "config.json").is_file():
            from pbkv.predict.predictor import PredictorLoadError, load_predictor
            try:
                predictors[variant] = load_predictor(model_dir)
            except PredictorLoadError as e:
                raise ValueError(str(e)) from None
            loaded = True
            horizon = predictors[variant].horizon
        else:
            predictors[variant] = empty_markov(horizon)
    learner = None
    if variant is not None and online:
        learner = TrafficLearner(variant=variant, horizon=horizon, every=learn_every, background=True,
                                 target_steps=learn_steps)
        learner.nice = learn_nice
    policy = make_policy(name, PolicyContext(block_size=block_size, predictors=predictors, online_learner=learner))
    return PolicySetup(policy, learner, variant, model_dir, loaded)


def finish_learning(setup: PolicySetup) -> Path | None:
    """At shutdown: wait for a retrain in progress, retrain on what is left (only when there is a
    --predictor to save it to), save. The path saved to, or None (nothing to save)."""
    policy, learner = setup.policy, setup.learner
    if learner is not None:
        newest = learner.finish(final_train=setup.model_dir is not None)
        if newest is not None:
            policy.predictor = newest
    if setup.model_dir is None:
        return None
    from pbkv.predict.predictor import NeuralPredictor
    predictor = getattr(policy, "predictor", None)
    if not isinstance(predictor, NeuralPredictor):
        log.info("no trained predictor to save to %s (too few workflows ended)", setup.model_dir)
        return None
    return save_atomic(predictor, setup.model_dir)


def save_atomic(predictor, folder: Path) -> Path:
    """Write into a sibling folder, then move each file over the old one (os.replace): a reader
    sees each file whole, old or new, never half-written."""
    from pbkv.predict.predictor import save_predictor
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    try:
        save_predictor(predictor, tmp)
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
