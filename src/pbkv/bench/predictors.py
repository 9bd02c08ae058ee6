"""Predictors for a benchmark: trained once in the main process, loaded by every worker.

Where the training data comes from, in order:
- `--predictor DIR`: a predictor saved by `pbkv train` (the "fused" variant);
- `--train FILE...`: trained on those traces (every variant the policies need);
- a generated workload: trained on the same generator with another seed (`seed + 1`), so the
  replayed workflows are never in the training set;
- a replayed trace with neither: an error (training on the replayed trace would test on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pbkv.policy.registry import needed_predictor


@dataclass(frozen=True)
class PredictorSource:
    predictor: str | None = None         # a saved predictor directory (the "fused" variant)
    train: tuple[str, ...] = ()          # trace files to train on
    horizon: int = 3
    epochs: int | None = None


def variants_needed(policies: list[str]) -> list[str]:
    return list(dict.fromkeys(v for p in policies if (v := needed_predictor(p)) is not None))


def prepare(sources, policies: list[str], psrc: PredictorSource, out: Path, progress=None, jobs: int = 1) -> dict:
    """Train or locate every predictor the sweep needs; return {(workload, variant): directory}.

    Trainings run in `jobs` worker processes (each trains on one thread); with one training or
    one job it runs here and `progress(step, steps)` follows its steps, else `progress(done, n)`
    counts finished trainings."""
    variants = variants_needed(policies)
    paths: dict[tuple[str, str], str] = {}
    todo: dict[str, tuple] = {}  # folder -> (trace files or generator source, variant)
    for source in sources:
        for variant in variants:
            if psrc.predictor and variant == "fused":
                paths[(source.name, variant)] = psrc.predictor
                continue
            if psrc.train:
                folder, data = out / f"train-{variant}", tuple(psrc.train)
            elif source.spec:
                folder, data = out / f"{source.name}-{variant}", source
            else:
                users = [p for p in policies if needed_predictor(p) == variant]
                raise ValueError(f"{', '.join(users)} needs a trained {variant} predictor to replay "
                                 f"{source.name}: pass --train FILE (or --predictor DIR)")
            todo[str(folder)] = (data, variant)
            paths[(source.name, variant)] = str(folder)
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


def training_trace(source):
    """The generator's workflows under another seed: the same workload, never the replayed runs."""
    from pbkv.workloads import generate, load_spec
    return generate(load_spec(source.spec), max(source.workflows, 500), source.seed + 1)


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
    save_predictor(predictor, Path(folder))
    return str(folder)


_loaded: dict[str, object] = {}


def load(path: str):
    """Load a saved predictor once per process (one torch thread: workers share the cores)."""
    import torch
    from pbkv.predict.predictor import load_predictor
    torch.set_num_threads(1)
    if path not in _loaded:
        _loaded[path] = load_predictor(path)
    return _loaded[path]


def online_learner(source, train_files: list[str], horizon: int):
    """A learner that keeps the offline training set and adds the run's finished workflows."""
    from pbkv.predict.online import OnlineLearner
    from pbkv.trace import read_trace
    base = [read_trace(f) for f in train_files] if train_files else (
        [training_trace(source)] if source.spec else [])
    return OnlineLearner(base=base, horizon=horizon)
