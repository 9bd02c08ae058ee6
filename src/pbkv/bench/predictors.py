"""Predictors for a benchmark: trained once in the main process, loaded by every worker.

Where the training data comes from, in order:
- `--predictor DIR`: a predictor saved by `pbkv train` (the "fused" variant); its live version is
  copied once into OUT/models/predictor/ (`snapshot`), and its name is recorded as each
  predicting run's `predictor_version`;
- `--train FILE...`: trained on those traces (every variant the policies need);
- a generated workload: trained on the same generator with another seed (`seed + 1`), so the
  replayed workflows are never in the training set; kept in `cache_dir()` (keyed by spec, seed,
  size, variant, horizon, epochs and a hash of the predictor and generator code) and reused;
- a replayed trace with neither: an error (training on the replayed trace would test on it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from pbkv.policy.registry import needed_predictor
from pbkv.predict.online import OnlineLearner
from pbkv.predict.store import has_predictor


# Workflows generated to train a generated workload's predictors (at least; more when the replay
# has more). Training runs a fixed budget of optimizer steps (`TrainOptions.target_steps`), so more
# workflows cost generation time, not training time: swe's fused predictor trained as fast on 2,000
# as on 500. With 500, swe's top-1 accuracy at k = 1 was 0.763 against 0.784 for the Bayes-optimal
# predictor of its spec (examples/bayes_policies.py); with 2,000 it is 0.782 (hover: 0.944 -> 0.946,
# already at its bound). docs/benchmarks.md, "What limits pbkv: the predictions".
TRAIN_WORKFLOWS = 2000
SNAPSHOT_FILES = ("config.json", "model.safetensors", "markov.json")   # what load_predictor reads


@dataclass(frozen=True)
class PredictorSource:
    predictor: str | None = None         # a saved predictor directory (the "fused" variant)
    train: tuple[str, ...] = ()          # trace files to train on
    horizon: int = 3
    epochs: int | None = None
    takes_predictor: bool = True         # the command has --predictor DIR (ablate has not): errors may advise it


def variants_needed(policies: list[str]) -> list[str]:
    return list(dict.fromkeys(v for p in policies if (v := needed_predictor(p)) is not None))


def prepare(sources, policies: list[str], psrc: PredictorSource, out: Path, progress=None, jobs: int = 1) -> dict:
    """Train or locate every predictor the sweep needs; return {(workload, variant): directory}.

    Trainings run in `jobs` worker processes (each trains on one thread); with one training or
    one job it runs here and `progress(step, steps)` follows its steps, else `progress(done, n)`
    counts finished trainings."""
    variants = variants_needed(policies)
    if psrc.predictor and psrc.train and set(variants) <= {"fused"}:   # not silently ignored
        raise ValueError("--train: nothing would be trained on it; --predictor gives the fused predictor, the "
                         "only one the chosen policies need (--train trains the others, e.g. pbkv-history's)")
    given = None   # a copy of --predictor's live version, made once: every worker loads it
    if psrc.predictor and "fused" in variants:
        out.mkdir(parents=True, exist_ok=True)
        given = snapshot(psrc.predictor, out)
        # the copy the workers load, checked now, not after the runs (`pbkv bench` checked the
        # folder itself first, naming it; a save may have made another version live since)
        given_predictor(given)
    paths: dict[tuple[str, str], str] = {}
    todo: dict[str, tuple] = {}  # folder -> (trace files or generator source, variant)
    for source in sources:
        for variant in variants:
            if psrc.predictor and variant == "fused":
                paths[(source.name, variant)] = given
                continue
            if psrc.train:
                folder, data = out / f"train-{variant}", tuple(psrc.train)
                _check_replaceable(folder)
            elif source.spec:
                folder, data = cache_folder(source, variant, psrc), source
                if has_predictor(folder):  # trained before, same code and data
                    paths[(source.name, variant)] = str(folder)
                    continue
            else:
                users = [p for p in policies if needed_predictor(p) == variant]
                other = " (or --predictor DIR)" if psrc.takes_predictor and variant == "fused" else ""
                raise ValueError(f"{', '.join(users)} needs a trained {variant} predictor to replay "
                                 f"{source.name}: pass --train FILE{other}")
            todo[str(folder)] = (data, variant)
            paths[(source.name, variant)] = str(folder)
    if any(not isinstance(data, tuple) for data, _ in todo.values()):
        check_cache_writable()  # before training, not after it
    if len(todo) <= 1 or jobs <= 1:
        for folder, (data, variant) in todo.items():
            _train_and_save(data, variant, psrc, folder, progress)
        return paths
    from concurrent.futures import ProcessPoolExecutor, as_completed
    with ProcessPoolExecutor(min(jobs, len(todo))) as pool:
        futures = [pool.submit(_train_and_save, data, variant, psrc, folder, None)
                   for folder, (data, variant) in todo.items()]
        for done, future in enumerate(as_completed(futures), 1):
            future.result()
            if progress:
                progress(done, len(futures))
    return paths


def snapshot(path: str, out: Path) -> str:
    """A copy of `path`'s live version in `out/predictor/NAME` (NAME: the version, `v000004`, or
    `flat` for a predictor without versions), made once in the main process; every worker loads
    the copy. So a save into `path` during the run (a server's retrains) can neither give the
    workers of one benchmark different predictors nor prune the version they load. An unreadable
    version pointer is left for `load_predictor(path)` to name."""
    from pbkv.predict.store import live_dir
    try:
        live = live_dir(path)
    except (OSError, ValueError):
        return path
    name = live.name if live != Path(path) else "flat"
    folder = out / "predictor"
    if live.resolve().is_relative_to(folder.resolve()):   # an earlier run's copy given back: one already
        return str(live)
    shutil.rmtree(folder, ignore_errors=True)   # an earlier run's copy: ours to replace
    (folder / name).mkdir(parents=True)
    for f in SNAPSHOT_FILES:
        if (live / f).is_file():
            shutil.copyfile(live / f, folder / name / f)
    return str(folder / name)


def version_name(paths: dict) -> str | None:
    """The version name (`v000004`) of the `--predictor` copy the runs used (`snapshot`), or None
    (no --predictor copy, or a flat predictor, which has no versions)."""
    from pbkv.predict.store import VERSION_NAME
    used = {Path(p) for (_, variant), p in paths.items() if variant == "fused"}
    if len(used) != 1:
        return None
    (folder,) = used
    return folder.name if folder.parent.name == "predictor" and VERSION_NAME.fullmatch(folder.name) else None


def given_predictor(path: str, horizon: int | None = None):
    """The `--predictor DIR` predictor, loaded. Raises ValueError unless it is the fused variant
    (the only one --predictor stands for: policy pbkv's; another variant would run and be reported
    as pbkv) and, when `horizon` (--horizon) is given, predicts at least that far ahead: checked
    before any run, not after the lru and oracle cells."""
    from pbkv.predict.base import require_variant
    from pbkv.predict.predictor import load_predictor
    p = load_predictor(path)
    require_variant(p, "fused", "pbkv", f"--predictor {path}", f", or give --train FILE for pbkv-{p.name}")
    if horizon is not None and horizon > p.horizon:
        raise ValueError(f"--horizon {horizon} exceeds the horizon {p.horizon} of --predictor {path}; "
                         f"give --horizon {p.horizon} or less, or leave it out")
    return p


def agent_notes(predictor, label: str, sources) -> list[str]:
    """One note per replayed workload with agents `predictor` (`label`: "--predictor DIR" or
    "--train FILE") never saw, as `pbkv predict-eval` prints: their calls are predicted as an
    unknown agent, which a policy comparison would not show."""
    from pbkv.bench.sweep import load_workload
    from pbkv.predict.evaluate import unseen_note
    notes = []
    for source in sources:
        note = unseen_note(set(predictor.agents), load_workload(source).trace)
        if note:
            notes.append(f"note: {source.name}: {label}: {note}")
    return notes


def cache_dir() -> Path:
    """Where predictors trained on generated workloads are kept: $PBKV_CACHE or ~/.cache/pbkv."""
    return Path(os.environ.get("PBKV_CACHE") or Path.home() / ".cache" / "pbkv")


def check_cache_writable() -> None:
    """Raise ValueError (naming the cache and the setting that chose it) when the predictor cache
    `cache_dir()/predictors` cannot be created or written: checked before training, so a bad
    $PBKV_CACHE never costs a training. Invariant: the nearest existing folder on its path is a
    writable folder, and nothing on the path is a file."""
    folder = cache_dir() / "predictors"
    where = f"$PBKV_CACHE={folder}" if os.environ.get("PBKV_CACHE") else f"the predictor cache {folder}"
    for path in (folder, *folder.parents):
        if not path.exists():
            continue
        if not path.is_dir():
            raise ValueError(f"{where}: {path} is not a folder (predictors trained for generated workloads are "
                             f"kept there; set $PBKV_CACHE to a writable folder)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{where}: {path} is not writable (predictors trained for generated workloads are "
                             f"kept there; set $PBKV_CACHE to a writable folder)")
        return


def code_version() -> str:
    """Hash of the code a trained predictor depends on (predictor, training, workload generator):
    any change there retrains."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for folder in ("predict", "workloads", "trace"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix in (".py", ".yaml") and f.is_file():
                digest.update(f.relative_to(root).as_posix().encode())
                digest.update(f.read_bytes())
    digest.update(Path(__file__).read_bytes())  # how training is called
    return digest.hexdigest()[:12]


def cache_folder(source, variant: str, psrc: PredictorSource) -> Path:
    """The cache entry of a generated workload's predictor: keyed by the workload's spec (its
    text for a spec file), training seed and size, variant, horizon, epochs and code version."""
    from pbkv.bench.sweep import is_spec_file
    from pbkv.workloads.spec_files import BUILTIN_DIR
    spec = Path(source.spec)
    text = (spec if is_spec_file(source.spec) else BUILTIN_DIR / f"{source.spec}.yaml").read_bytes()
    spec_hash = hashlib.sha256(text).hexdigest()[:8]
    name = (f"{source.name}-{spec_hash}-seed{source.seed + 1}-n{max(source.workflows, TRAIN_WORKFLOWS)}-{variant}"
            f"-k{psrc.horizon}-e{psrc.epochs or 'd'}-{code_version()}")
    return cache_dir() / "predictors" / name


def _check_replaceable(folder: Path) -> None:
    """A `--train` run replaces OUT/train-VARIANT with the predictor it trains: refuse (before
    training) when that folder holds anything but a saved predictor, which would be deleted."""
    from pbkv.predict.store import check_target
    try:
        check_target(folder)
    except ValueError as e:
        raise ValueError(f"--train saves its predictor to {folder}, replacing it: {e}") from None


def training_trace(source):
    """The generator's workflows under another seed: the same workload, never the replayed runs."""
    from pbkv.workloads import SpecError, generate
    n = max(source.workflows, TRAIN_WORKFLOWS)
    try:
        return generate(source.spec, n, source.seed + 1)
    except SpecError as e:   # the user asked for fewer workflows than this: say which trace it is
        raise SpecError(f"the trace pbkv trains its predictor on ({n:,} workflows of the spec, seed "
                        f"{source.seed + 1}: at least {TRAIN_WORKFLOWS:,} whatever --workflows): {e}; "
                        f"or give --train FILE or --predictor DIR") from None


def _train_and_save(data, variant, psrc: PredictorSource, folder, progress) -> str:
    """Train on `data` (trace files, or a generator source: its seed + 1 workflows) and save."""
    from pbkv.predict.predictor import save_predictor
    from pbkv.predict.train import train_predictor
    from pbkv.trace import read_trace
    traces = [read_trace(f) for f in data] if isinstance(data, tuple) else [training_trace(data)]
    kwargs = {"variant": variant, "horizon": psrc.horizon, "seed": 0}
    if psrc.epochs:
        kwargs["epochs"] = psrc.epochs
    predictor = train_predictor(traces, progress=progress, **kwargs)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # made with mkdir, not mkdtemp: the entry gets the umask's mode (mkdtemp's 0700 would hide it
    # from other accounts sharing $PBKV_CACHE, which would train it again and fail to replace it)
    tmp = folder.parent / f"{folder.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    save_predictor(predictor, tmp)  # whole or nothing: a concurrent or killed run never sees half
    _remove_entry(folder)
    try:
        tmp.rename(folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not has_predictor(folder):   # not another run's entry, finished first (then: keep theirs)
            raise OSError(f"{folder}: cannot put the predictor just trained in place ({e.strerror or e}); "
                          f"delete {folder} and run again") from None
    return str(folder)


def _remove_entry(folder: Path) -> None:
    """Remove what holds a cache entry's name before the new one is renamed onto it: an older
    predictor folder, or a file or symlink left there (a full disk, a sync tool), which rmtree
    would leave in place, failing the rename on every run."""
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)
    elif os.path.lexists(folder):
        folder.unlink(missing_ok=True)


_loaded: dict[str, object] = {}


def load(path: str):
    """Load a saved predictor once per process (one torch thread: workers share the cores)."""
    import torch
    from pbkv.predict.predictor import load_predictor
    torch.set_num_threads(1)
    if path not in _loaded:
        try:
            _loaded[path] = load_predictor(path)
        except ValueError as e:   # PredictorLoadError
            raise type(e)(f"{e}{_cache_advice(path)}") from None
    return _loaded[path]


def _cache_advice(path: str) -> str:
    """For a predictor in bench's cache: what it is and how to get a sound one (a damaged entry
    would otherwise fail every later bench of its workload the same way); else ''."""
    cache = cache_dir() / "predictors"
    try:
        inside = Path(path).resolve().parent == cache.resolve()
    except OSError:
        return ""
    if not inside:
        return ""
    where = f"$PBKV_CACHE={cache_dir()}" if os.environ.get("PBKV_CACHE") else str(cache_dir())
    return (f" ({path} is bench's cached predictor, kept under {where}: delete that folder and the next "
            f"bench trains it again)")


# --online in a replay: a retrain every this many finished workflows (a server's is --learn-every)
LEARN_EVERY = 200


def online_learner(source, train_files: list[str], predictor) -> ReplayLearner:
    """A learner that keeps the offline training set and adds the run's finished workflows. It
    retrains `predictor`'s variant at `predictor`'s horizon (a learner at another horizon would
    silently change the run's after its first retrain), every `LEARN_EVERY` workflows, and a
    retrain is used only when trained on as many workflows as `predictor` (or all it can reach)."""
    from pbkv.trace import read_trace
    base = [read_trace(f) for f in train_files] if train_files else (
        [training_trace(source)] if source.spec else [])
    learner = ReplayLearner(base=base, variant=predictor.name, horizon=predictor.horizon, every=LEARN_EVERY)
    reachable = sum(len(t.workflows()) for t in base) + learner.window.maxlen
    learner.floor = min(predictor.info.get("workflows", 0), reachable)
    return learner


class ReplayLearner(OnlineLearner):
    """`OnlineLearner` of a replay. A retrain on fewer than `floor` workflows is not used (counted
    in `dropped`): with --predictor and no --train it learns from the replayed workflows alone,
    and 200 of them would replace a predictor trained on thousands (a server guards the same way:
    serve.learning.TrafficLearner). `used` counts the retrains swapped in."""

    floor = 0
    dropped = 0
    used = 0

    def poll(self):
        predictor = super().poll()
        if predictor is None:
            return None
        if predictor.info.get("workflows", 0) < self.floor:
            self.dropped += 1
            return None
        self.used += 1
        return predictor
