"""Who comes next: per-workflow predictions of the next K agents and of the workflow's end.

    from pbkv.predict import train_predictor, evaluate, save_predictor, load_predictor
    p = train_predictor(traces, variant="fused", horizon=3, seed=0)
    pred = p.predict(["planner", "retriever"], context="task: ...")   # a Prediction
    pred.probs[k - 1]   # agent of call s+k given alive (known agents, then "<unk>")
    pred.survival       # P(call s+k happens), non-increasing

Layer rule: imports only `pbkv.trace` and third-party libraries. The torch-based names are imported lazily:
`pbkv.predict`, its Markov baseline and its evaluation load without torch.
"""

from importlib import import_module

from pbkv.predict.base import END, UNK, Prediction, Predictor, check_prediction
from pbkv.predict.evaluate import evaluate
from pbkv.trace.transform import split_by_task
from pbkv.predict.markov import MarkovPredictor, fit_markov
from pbkv.predict.store import has_predictor

_LAZY = {"NeuralPredictor": "predictor", "PredictorLoadError": "predictor", "save_predictor": "predictor",
         "load_predictor": "predictor", "train_predictor": "train"}  # these load torch
__all__ = ["Prediction", "Predictor", "UNK", "END", "check_prediction", "evaluate", "split_by_task",
           "MarkovPredictor", "fit_markov", "has_predictor", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"pbkv.predict.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'pbkv.predict' has no attribute {name!r}")
