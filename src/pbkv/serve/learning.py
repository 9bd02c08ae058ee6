"""The policy a server runs, its predictor, and learning from the traffic it serves.

- `--predictor DIR` with a predictor saved by `pbkv train` (or by an earlier `pbkv serve`): it is
  loaded; without one (or without the option) a policy that predicts starts from an empty Markov
  chain, which predicts nothing useful, so the quality monitor's trust falls and the order is
  LRU's until the first retrain;
- online learning (on by default for predicting policies): the policy hands every ended workflow
  to `TrafficLearner` (retrains in a child process, serving never waits) and swaps in the new
  predictor when it is ready (`PBKVPolicy._learn`);
- each background retrain that is used is saved to `--predictor` at once, on the retrain's
  thread (serving never waits): a server killed without a graceful stop (SIGKILL, out of
  memory, Ray replacing a frozen replica) keeps what it learned up to its last retrain;
- on shutdown the newest neural predictor is saved back to `--predictor` (after a last retrain
  on workflows not yet learned from) as a new version made live atomically, with the learning
  window's workflows (`pbkv.predict.history`): the next server on that folder starts its
  window with them, so learning goes on across restarts;
- with `--no-online` nothing is learned, so nothing is saved: `--predictor` is only read (it may
  be read-only; its learning history, `workflows.json`, is not read at all) and restarts never
  add versions that would rotate older ones out.
Policies that read a trace's future (the oracle) cannot serve: a server has no future.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import Pipe, get_context
from pathlib import Path

import numpy as np

from pbkv.policy import PolicyContext
from pbkv.policy.registry import make_policy, needed_predictor, needs_future, predicting_policies
from pbkv.predict.base import require_variant
from pbkv.predict.history import read_history
from pbkv.predict.online import OnlineLearner
from pbkv.predict.store import check_target, has_predictor, live_dir
from pbkv.serve.workflows import DEFAULT_AGENT
from pbkv.stale import remove_stale

log = logging.getLogger("pbkv.serve")
MIN_FINAL_TRAIN = 10   # ended workflows needed for the retrain at shutdown
DEFAULT_NICE = 10      # the retrain process yields the CPU to the server (0: an equal share)
TEMP_STALE = r"pbkv-learn-(?P<pid>\d+)-.*"   # a retrain's temporary folder, named with its server's PID


@dataclass
class PolicySetup:
    policy: object
    learner: object | None
    variant: str | None
    predictor_dir: Path | None
    loaded: bool
    history: list = field(default_factory=list)   # workflows saved with the loaded predictor
    save_error: str | None = None   # why the shutdown save failed (`pbkv serve` then exits 1)
    # `pbkv serve --replicas`: too few workflows ended here to train at shutdown, so they are kept
    # in `unsaved` for the ingress to train on with the other replicas' (pbkv.scale.handoff)
    hand_off: bool = False
    unsaved: list = field(default_factory=list)


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
    dropped = 0        # retrains not used: below `floor`, or lost with their process
    taking = True      # False once the server stops: runs still open then are cut short, not finished
    cut = 0            # workflows heard after that, not learned
    nice = DEFAULT_NICE
    floor = 0          # a retrain on fewer workflows is not used (`build_policy`: the loaded predictor's)
    save_to: Path | None = None   # `--predictor`: where each used background retrain is saved at once
    save_error: str | None = None  # why the last such save failed (logged; the shutdown save tries again)
    _pool = None
    _lifeline = None
    _killing = False   # set by `close(kill=True)`: a broken pool is then expected

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # ids of the window's workflows the --predictor folder already holds (loaded from it, or
        # saved there since): a save adds only the others (`history.merge_with_live`)
        self.in_folder: set[str] = set()

    def remember(self, workflows) -> None:
        super().remember(workflows)
        if workflows:
            with self._lock:
                self.in_folder.update(wf[0].workflow_id for wf in list(self.window)[-len(workflows):])

    def unsaved_workflows(self) -> list[list[tuple[str, str | None]]]:
        """The window's workflows the folder does not hold yet, oldest first."""
        with self._lock:
            return [[(c.agent, c.context) for c in wf] for wf in self.window if wf[0].workflow_id not in self.in_folder]

    def poll(self):
        """`OnlineLearner.poll`, but a predictor trained on fewer than `floor` workflows is
        dropped: retrains learn from the window (this session's traffic, after the workflows
        saved with the loaded predictor; none for one from `pbkv train`), so one made after a few
        dozen workflows would replace a predictor trained on thousands (and forget its agents)."""
        return self._above_floor(super().poll())

    def _above_floor(self, predictor):
        """`predictor`, or None when it was trained on fewer than `floor` workflows (logged)."""
        if predictor is not None and predictor.info.get("workflows", 0) < self.floor:
            log.info("not using a retrain on %d workflows: the loaded predictor was trained on %d",
                     predictor.info.get("workflows", 0), self.floor)
            self.dropped += 1
            return None
        return predictor

    def add(self, agents: list[str], contexts: list[str | None]) -> None:
        if not self.taking:
            self.cut += 1
            return
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
            remove_stale(tempfile.gettempdir(), TEMP_STALE)   # a killed server's (its PID is in the name)
            self._pool, self._lifeline = start_pool(self.nice)
        with tempfile.TemporaryDirectory(prefix=f"pbkv-learn-{os.getpid()}-") as folder:
            try:
                self._pool.submit(_train_in_child, traces, self.variant, self.horizon, self.seed + self.retrains,
                                  self.target_steps, folder).result()
                predictor = load_predictor(folder)
            except Exception as e:   # a thread that raises would lose this retrain without a word
                if not self._killing:
                    log.error("a retrain failed (%s: %s); serving goes on with the predictor in use",
                              type(e).__name__, e)
                    self.dropped += 1
                return
        if self.save_to is not None and predictor.info.get("workflows", 0) >= self.floor:
            self._save(predictor, traces[-1])
        with self._lock:
            self._ready = predictor
            self.retrains += 1
            self.seconds += time.perf_counter() - start

    def _save(self, predictor, window) -> None:
        """Save a retrain to `save_to` with the workflows it learned from (`window`: the trace of
        the learning window when it started), merged with the live version's as at shutdown."""
        by_id = window.workflows()
        with self._lock:
            workflows = [[(c.agent, c.context) for c in calls] for wid, calls in by_id.items()
                         if wid not in self.in_folder]
        try:
            save_atomic(predictor, self.save_to, workflows, self.window.maxlen)
            self.save_error = None
            with self._lock:   # only ids still in the window: the set stays as small as the window
                self.in_folder = (self.in_folder | set(by_id)) & {wf[0].workflow_id for wf in self.window}
            log.info("saved a retrain (%d workflows) to %s", len(workflows), self.save_to)
        except (OSError, ValueError) as e:   # the folder changed since start-up: serving goes on
            self.save_error = str(e)
            log.error("cannot save a retrain to %s: %s (serving goes on; shutdown tries again)", self.save_to, e)

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
        return self._above_floor(newest)   # the retrain in progress too: nothing below it is saved

    def close(self, kill: bool = False) -> None:
        if self._pool is not None:
            if kill:
                self._killing = True
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    proc.kill()   # SIGKILL: the child ignores SIGTERM (`_child_init`)
            self._pool.shutdown(wait=True, cancel_futures=True)  # quick once killed; frees its locks
            self._lifeline.close()
            self._pool = self._lifeline = None


def start_pool(nice: int):
    """The one-process pool that runs retrains. Its process exits when this one dies, however it
    dies (kill -9 included): it holds the read end of a pipe whose only write end stays here,
    and a thread of the child waits on it; the kernel closes the write end when this process
    ends, the read returns, and the child exits. (Linux's PR_SET_PDEATHSIG is not used: it fires
    when the *thread* that spawned the child ends, and the pool spawns from a retrain thread.)
    Returns (pool, lifeline): keep the lifeline (the write end) open as long as the pool."""
    reader, writer = Pipe(duplex=False)
    pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_child_init,
                               initargs=(nice, reader, os.getpid()))
    return pool, writer


def _child_init(nice: int, lifeline, parent: int) -> None:
    # Ctrl-C in a terminal (SIGINT) and a service manager's stop (SIGTERM) reach the whole
    # process group: the server shuts down gracefully and waits for this retrain to save it,
    # so the child must not die of them. It still exits with its parent (`_exit_with_parent`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(nice)
    except OSError:
        pass
    threading.Thread(target=_exit_with_parent, args=(lifeline, parent), daemon=True,
                     name="pbkv-parent-watch").start()


def _exit_with_parent(lifeline, parent: int) -> None:
    """Block until the parent's end of the pipe closes (or the parent PID goes), then exit now:
    an orphaned retrain has nobody to report to and holds hundreds of MB."""
    while True:
        try:
            if lifeline.poll(1.0):
                lifeline.recv()  # nothing is ever sent: this raises EOFError once the parent is gone
        except (EOFError, OSError):
            break
        if os.getppid() != parent:  # reparented: a fallback where the pipe is not closed
            break
    os._exit(1)


def _train_in_child(traces, variant: str, horizon: int, seed: int, steps: int, folder: str) -> str:
    from pbkv.predict.predictor import save_predictor
    from pbkv.predict.train import train_predictor
    save_predictor(train_predictor(traces, variant=variant, horizon=horizon, seed=seed, target_steps=steps), folder)
    return folder


def empty_markov(horizon: int):
    from pbkv.predict.markov import MarkovPredictor
    return MarkovPredictor([], np.zeros((2, 2)), horizon)


def build_policy(name: str, block_size: int, predictor_dir: str | Path | None = None, online: bool = True,
                 learn_every: int = 50, horizon: int = 3, learn_steps: int = 300,
                 learn_nice: int = DEFAULT_NICE) -> PolicySetup:
    """Raises ValueError (unknown policy, a future-reading policy, an unreadable predictor, a
    `predictor_dir` the policy does not read, one holding no predictor without `online`, or with
    `online` one a shutdown save could not write)."""
    if needs_future(name):
        raise ValueError(f"policy {name!r} reads the future of a replayed trace; a server has none "
                         f"(use lru, kvflow or pbkv)")
    variant = needed_predictor(name)
    predictor_dir = Path(predictor_dir) if predictor_dir else None
    if predictor_dir is not None and variant is None:   # else silently unused
        raise ValueError(f"--predictor {predictor_dir}: policy {name} reads no trained predictor (policies "
                         f"that do: {', '.join(predicting_policies())}); leave --predictor out")
    predictors, loaded, history = {}, False, []
    if variant is not None:
        if predictor_dir is not None and has_predictor(predictor_dir):
            predictors[variant], history = load_with_history(predictor_dir, online)
            require_variant(predictors[variant], variant, name, f"--predictor {predictor_dir}")
            loaded, horizon = True, predictors[variant].horizon
        elif predictor_dir is not None and not online:   # a typo: nothing would ever be loaded or saved
            raise ValueError(f"--predictor {predictor_dir}: holds no saved predictor, and with --no-online "
                             f"nothing is learned or saved there; give a folder `pbkv train` or a learning "
                             f"server saved into, or leave out --no-online to start learning into it")
        else:
            predictors[variant] = empty_markov(horizon)
        if predictor_dir is not None and online:  # saved there on shutdown: refuse now what would fail that save
            check_saving_target(predictor_dir)
    learner = None
    if variant is not None and online:
        learner = TrafficLearner(variant=variant, horizon=horizon, every=learn_every, background=True,
                                 target_steps=learn_steps)
        learner.nice = learn_nice
        trained_on = predictors[variant].info.get("workflows", 0) if loaded else 0
        learner.floor = min(trained_on, learner.window.maxlen)   # reachable by the window
        learner.save_to = predictor_dir
        learner.remember(history)
    policy = make_policy(name, PolicyContext(block_size=block_size, predictors=predictors, online_learner=learner))
    return PolicySetup(policy, learner, variant, predictor_dir, loaded, history)


def check_saving_target(predictor_dir: Path) -> None:
    """Raise ValueError when a learning server could not save to `predictor_dir` at shutdown,
    saying why it writes there and what to do instead (a read-only folder is served with
    --no-online, which never writes)."""
    try:
        check_target(predictor_dir)
    except ValueError as e:
        raise ValueError(f"{e} (pbkv serve saves what it learns to --predictor; pass --no-online to serve "
                         f"it read-only, or copy it to a writable folder)") from None


def load_with_history(predictor_dir: Path, with_history: bool = True):
    """(predictor, the workflows saved with it), both from one version: the live folder is
    resolved once, so a save by another server in between cannot pair them across versions.
    Without `with_history` (a server that does not learn: they are its learning window only) the
    workflows are [] and never read, so a damaged `workflows.json` does not stop read-only
    serving; a learning server refuses it at start (its saves would drop that traffic).
    Raises ValueError naming the file."""
    from pbkv.predict.predictor import PredictorLoadError, load_predictor
    try:
        live = live_dir(predictor_dir)
        return load_predictor(live), read_history(live) if with_history else []
    except (PredictorLoadError, OSError) as e:
        raise ValueError(str(e)) from None


def finish_learning(setup: PolicySetup) -> Path | None:
    """At shutdown: wait for a retrain in progress, retrain on what is left (only when there is a
    --predictor to save it to), save. The path saved to, or None (nothing to save, or the save
    failed: logged as one error line and kept in `setup.save_error`)."""
    policy, learner = setup.policy, setup.learner
    if learner is not None and learner.cut:
        log.info("%d workflow(s) still running at shutdown not learned (cut short, not finished)", learner.cut)
    if learner is not None:
        newest = learner.finish(final_train=setup.predictor_dir is not None)
        if newest is not None:
            policy.predictor = newest
    if setup.predictor_dir is None:
        return None
    if learner is None:   # --no-online: nothing learned, the folder is left as it was (it may be read-only)
        return None
    from pbkv.predict.predictor import NeuralPredictor
    predictor = getattr(policy, "predictor", None)
    if not isinstance(predictor, NeuralPredictor):
        if learner is not None and setup.hand_off:
            setup.unsaved = learner.unsaved_workflows()
            log.info("%d ended workflows left to the ingress to train on with the other replicas'",
                     len(setup.unsaved))
        elif learner is not None:   # the session's workflows are lost: say so where an operator looks
            log.warning("nothing saved to %s: a predictor is first trained at shutdown once %d workflows "
                        "with agent hints have ended (%d did); they are not kept", setup.predictor_dir,
                        MIN_FINAL_TRAIN, len(learner.window))
        return None
    history = learner.unsaved_workflows() if learner is not None else setup.history
    window = learner.window.maxlen if learner is not None else None   # keep other servers' workflows
    try:
        return save_atomic(predictor, setup.predictor_dir, history, window)
    except (OSError, ValueError) as e:   # the folder changed since start-up (checked then): one line, no traceback
        log.error("cannot save the predictor to %s: %s", setup.predictor_dir, e)
        setup.save_error = str(e)
        return None


def save_atomic(predictor, folder: Path, history: list | None = None, window: int | None = None) -> Path:
    """Save as a new version of `folder`, made live in one atomic step (`pbkv.predict.store`):
    a reader, or a server killed mid-save, sees the old predictor or the new one, each whole.
    `window`: see `save_predictor`."""
    from pbkv.predict.predictor import save_predictor
    return save_predictor(predictor, folder, history, window)
