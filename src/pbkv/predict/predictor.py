"""`NeuralPredictor`: the trained network behind the `Predictor` interface, plus save/load.

A saved predictor is a directory holding one complete version of these files (no pickle
anywhere), saved atomically by `pbkv.predict.store` (`DIR/CURRENT` names the live `DIR/vNNNNNN/`):
- `model.safetensors`: every weight and the graph buffers;
- `config.json`: format and version, known agents, model dims and variant, feature/hashing
  parameters, the fitted temperatures, training info;
- `markov.json`: the Markov baseline fit on the same training data (for evaluation reports).
`load_predictor(save_predictor(p))` gives bit-identical predictions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pbkv import unique_json
from pbkv.files import write_tensors
from pbkv.predict import store
from pbkv.predict.history import merge_with_live, write_history
from pbkv.predict.base import UNK, Prediction, monotone_survival, normalise_rows
from pbkv.predict.features import WORD, Featurizer
from pbkv.predict.markov import MarkovPredictor, check_agents
from pbkv.predict.model import ModelConfig, PredictorNet
from pbkv.trace.io import show_value

FORMAT, VERSION = "pbkv-predictor", 1
CHUNK = 1024  # rows per forward pass in predict_batch (bounds memory on long traces)
# The temperatures config.json may hold: training fits 0.25 to 8 (`train.TEMPERATURES`); dividing
# the logits by a tiny one (1e-320 is finite and > 0) overflows to infinity, so NaN probabilities.
TEMPERATURES = (1e-3, 1e3)


class PredictorLoadError(ValueError):
    """A saved predictor directory is missing, incomplete or corrupt (message: path + what)."""


class NeuralPredictor:
    """Wraps `PredictorNet`: features in, calibrated `Prediction`s out. Always in eval mode."""

    def __init__(self, net: PredictorNet, agents: list[str], t_agent=None, t_cont=None,
                 markov: MarkovPredictor | None = None, info: dict | None = None):
        self.net = net.eval()
        self.cfg: ModelConfig = net.cfg
        self.agents = list(agents)
        self.name, self.horizon = self.cfg.variant, self.cfg.horizon
        self.feat = Featurizer(self.agents, self.cfg.features)
        k = self.horizon
        self.t_agent = np.ones(k) if t_agent is None else np.asarray(t_agent, dtype=np.float64)
        self.t_cont = np.ones(k) if t_cont is None else np.asarray(t_cont, dtype=np.float64)
        self.markov, self.info = markov, dict(info or {})

    @property
    def classes(self) -> list[str]:
        return self.agents + [UNK]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def tensors(self, items: list[tuple[list[str], str | None]], hiddens=None) -> dict[str, torch.Tensor]:
        """Model inputs for `items` (text features only when the model reads text)."""
        cfg = self.cfg
        text = cfg.uses_context and cfg.context_dim == 0
        x = {k: torch.from_numpy(v) for k, v in self.feat.batch(items, text=text).items()}
        if cfg.uses_context and cfg.context_dim > 0:
            x["hidden"] = self._hidden(hiddens, len(items))
        return x

    def _hidden(self, hiddens, n: int) -> torch.Tensor:
        dim = self.cfg.context_dim
        out = np.zeros((n, dim), dtype=np.float32)  # no hidden state: a zero vector (neutral input)
        for i, h in enumerate(hiddens or [None] * n):
            if h is not None:
                h = np.asarray(h, dtype=np.float32).reshape(-1)
                if h.shape != (dim,):
                    raise ValueError(f"hidden must have {dim} values, got {h.shape[0]}")
                out[i] = np.nan_to_num(h)
        return torch.from_numpy(out)

    def logits(self, items, hiddens=None) -> tuple[np.ndarray, np.ndarray]:
        """Raw (uncalibrated) agent logits [N, K, A+1] and continuation logits [N, K], float64."""
        if not items:
            return np.zeros((0, self.horizon, len(self.agents) + 1)), np.zeros((0, self.horizon))
        with torch.inference_mode():
            outs = [self.net(self.tensors(items[i:i + CHUNK], None if hiddens is None else hiddens[i:i + CHUNK]))
                    for i in range(0, len(items), CHUNK)]
            a, c = outs[0] if len(outs) == 1 else (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
            return a.double().numpy(), c.double().numpy()

    def to_predictions(self, agent_logits: np.ndarray, cont_logits: np.ndarray) -> list[Prediction]:
        """Apply the temperatures: softmax(agent / T_k), survival = cumprod(sigmoid(cont / T_k))."""
        z = agent_logits / self.t_agent[None, :, None]
        z = np.exp(z - z.max(axis=-1, keepdims=True))
        probs = normalise_rows(z)
        cont = 1.0 / (1.0 + np.exp(-np.clip(cont_logits / self.t_cont[None, :], -60, 60)))
        surv = np.cumprod(cont, axis=1)
        classes = self.classes
        return [Prediction(classes, probs[i], monotone_survival(surv[i])) for i in range(len(probs))]

    def predict_batch(self, items: list[tuple[list[str], str | None]], hiddens=None) -> list[Prediction]:
        return self.to_predictions(*self.logits(items, hiddens))

    def predict(self, history: list[str], context: str | None = None,
                hidden: np.ndarray | None = None) -> Prediction:
        return self.predict_batch([(list(history), context)], None if hidden is None else [hidden])[0]


def save_predictor(p: NeuralPredictor, path: str | Path, history: list | None = None,
                   window: int | None = None) -> Path:
    """Write `p` as a new version of the directory `path` (created if needed) and make it live
    atomically: a reader, or a writer killed at any point, sees the old predictor or the new one,
    each complete. `history`: the workflows to keep with it (`pbkv.predict.history`); with
    `window`, also the live version's workflows it lacks, `window` at most in all. Returns `path`."""
    def write(folder: Path) -> None:
        _write_files(p, folder)
        if history is not None:
            rows = history if window is None else merge_with_live(path, history, window)
            write_history(folder, rows)
    return store.publish(path, write)


def _write_files(p: NeuralPredictor, path: Path) -> None:
    state = {k: v.detach().contiguous().clone() for k, v in p.net.state_dict().items()}
    # one metadata key: safetensors writes a map's keys in a random order, so two saves of the same
    # weights differed in their header bytes (the version is config.json's, which loading checks)
    write_tensors(path / "model.safetensors", state, metadata={"format": f"{FORMAT} {VERSION}"})
    store.on_step("model.safetensors")
    copies = _copies(p.cfg)
    config = {
        "format": FORMAT, "version": VERSION, "agents": p.agents, "horizon": copies["horizon"],
        "variant": copies["variant"], "model": p.cfg.to_dict(),
        "temperature": {"agent": p.t_agent.tolist(), "continue": p.t_cont.tolist()},
        "hashing": copies["hashing"], "info": p.info,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    store.on_step("config.json")
    if p.markov is not None:
        p.markov.save(path / "markov.json")
        store.on_step("markov.json")



def load_predictor(path: str | Path) -> NeuralPredictor:
    """Read a directory written by `save_predictor`; raise `PredictorLoadError` naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise PredictorLoadError(f"{path}: no such predictor directory")
    try:
        path = store.live_dir(path)  # resolved once: every file below comes from one version
    except (OSError, ValueError) as e:
        raise PredictorLoadError(f"{path}: unreadable version pointer ({e})") from None
    cfg_path, w_path = path / "config.json", path / "model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise PredictorLoadError(f"{p}: missing (not a saved predictor directory?)")
    try:
        mcfg, agents, temp, info = _check_config(unique_json.loads(cfg_path.read_text()))
    except RecursionError:
        raise PredictorLoadError(f"{cfg_path}: invalid config (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise PredictorLoadError(f"{cfg_path}: invalid config ({e})") from None
    net = PredictorNet(mcfg)
    try:
        state = load_file(str(w_path))
    except (SafetensorError, RuntimeError, OSError, ValueError) as e:
        raise PredictorLoadError(f"{w_path}: cannot load weights ({str(e).splitlines()[0]})") from None
    problem = _state_problem(state, net, mcfg) or _non_finite(state)
    if problem:
        raise PredictorLoadError(f"{w_path}: {problem}")
    net.load_state_dict(state, strict=True)
    markov = None
    if (path / "markov.json").exists():
        try:
            markov = MarkovPredictor.load(path / "markov.json")
        except ValueError as e:
            raise PredictorLoadError(str(e)) from None
        problem = _markov_problem(markov, agents, mcfg.horizon)
        if problem:
            raise PredictorLoadError(f"{path / 'markov.json'}: {problem}")
    return NeuralPredictor(net, agents, temp["agent"], temp["continue"], markov, info)


def _markov_problem(markov: MarkovPredictor, agents: list[str], horizon: int) -> str | None:
    """Why `markov` is not the baseline fit with the network config.json describes, or None.
    `train_predictor` fits both on the same workflows at one horizon: the Markov chain knows
    every agent, the network those with enough calls, so config.json's agents are among
    markov.json's. A markov.json copied from another predictor otherwise loads and its
    comparison row silently scores other agents, or other steps."""
    if markov.horizon != horizon:
        return f"field 'horizon' is {markov.horizon}, config.json's is {horizon}"
    missing = [a for a in agents if a not in markov.index]
    if missing:
        shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return f"field 'agents' lacks {shown} of config.json's agents (another predictor's baseline?)"
    return None


# config.json fields that set each tensor's shape (by the tensor name's first part), named in a
# shape mismatch: a hand-edited config.json or a weights file copied from another predictor.
SHAPED_BY = {
    "adj_out": ("n_agents",), "adj_in": ("n_agents",), "node": ("n_agents", "dim"),
    "sage": ("graph_layers", "dim"), "pos": ("features.window", "dim"), "qkv": ("dim",),
    "state": ("n_agents", "features.max_count", "features.max_step", "dim"),
    "text": ("features.buckets", "dim"), "proj": ("context_dim", "dim"),
    "mlp": ("hidden", "recent", "dim", "n_agents", "context_dim"), "head": ("horizon", "n_agents", "hidden"),
}


def _state_problem(state: dict, net: PredictorNet, mcfg: ModelConfig) -> str | None:
    """What stops `state` (model.safetensors' tensors) from fitting the network config.json
    describes, naming tensors, shapes and the config fields behind them; None when it fits.
    torch's own message names none of these (its first line is a bare header). Each tensor has
    the network's dtype (float32, as `_write_files` saves it): `load_state_dict` would cast
    integer or bool tensors to float without a word, and predict with the collapsed weights."""
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        parts = [f"{label} tensors {_names(keys)}" for label, keys in (("missing", missing), ("unexpected", extra)) if keys]
        return (f"{'; '.join(parts)} for config.json's variant {mcfg.variant!r} "
                f"(a weights file of another variant or model?)")
    for name, want in expected.items():
        got = state[name]
        if tuple(got.shape) != tuple(want.shape):
            return (f"tensor {name} has shape {list(got.shape)}, config.json ({_fields(name, mcfg)}) "
                    f"expects {list(want.shape)}")
        if got.dtype != want.dtype:
            return f"tensor {name} has dtype {_dtype(got)}, expected {_dtype(want)} (the network's)"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _fields(tensor: str, mcfg: ModelConfig) -> str:
    """'model.FIELD VALUE, ...' for the config fields shaping `tensor`."""
    out = []
    for name in SHAPED_BY.get(tensor.split(".")[0], ()):
        obj, attr = (mcfg.features, name.split(".")[1]) if "." in name else (mcfg, name)
        out.append(f"model.{name} {getattr(obj, attr)}")
    return ", ".join(out)


def _non_finite(state: dict) -> str | None:
    """The first floating tensor holding NaN or infinity, named, or None. A diverged training or a
    damaged file loads fine otherwise, and NaN logits become uniform probabilities and survival 0
    that the policy would use without a word."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return f"tensor {name} holds {bad:,} non-finite values (NaN or infinity) of {t.numel():,}"
    return None


def _check_config(config) -> tuple[ModelConfig, list[str], dict, dict]:
    """(model config, agents, temperatures, info) of config.json's JSON value; every field is
    checked here, before anything is allocated: a ValueError names the field and the value."""
    if not isinstance(config, dict):
        raise ValueError(f"expected a JSON object, got {show_value(config)}")
    if config.get("format") != FORMAT:
        raise ValueError(f"format is {config.get('format')!r}, expected {FORMAT!r}")
    if config.get("version") != VERSION:
        raise ValueError(f"version {config.get('version')!r} is not supported (expected {VERSION})")
    mcfg = ModelConfig.from_dict(config.get("model"))
    _check_copies(config, mcfg)
    agents = check_agents(config.get("agents"))
    if len(agents) != mcfg.n_agents:
        raise ValueError(f"{len(agents)} agents but the model has {mcfg.n_agents}")
    temp = config.get("temperature")
    _check_temperatures(temp, mcfg.horizon)
    return mcfg, agents, temp, _check_info(config.get("info"))


# config.json's copies of model fields (`_copies`) and the field each one copies
COPIED_FROM = {"horizon": "model.horizon", "variant": "model.variant", "hashing.buckets": "model.features.buckets",
               "hashing.max_chars": "model.features.max_chars", "hashing.max_tokens": "model.features.max_tokens"}


def _copies(cfg: ModelConfig) -> dict:
    """The fields config.json repeats for its readers: the top-level `horizon` and `variant`, and
    `hashing` (how context text is hashed: fixed, or copied from `model.features`)."""
    f = cfg.features
    return {"horizon": cfg.horizon, "variant": cfg.variant,
            "hashing": {"method": "zlib.crc32 % buckets", "tokens": WORD.pattern, "lowercase": True,
                        "buckets": f.buckets, "max_chars": f.max_chars, "max_tokens": f.max_tokens}}


def _check_copies(config: dict, mcfg: ModelConfig) -> None:
    """Each of `_copies`' fields present in `config` equals the model's: only `model` counts at
    load, so a copy edited by hand (`"horizon": 5` beside `model.horizon` 3) would be ignored
    without a word. Raise ValueError naming the field, its value and what it copies."""
    want = _copies(mcfg)
    hashing = config.get("hashing", want["hashing"])
    if not isinstance(hashing, dict):
        raise ValueError(f"field 'hashing': expected an object, got {show_value(hashing)}")
    pairs = [(k, config.get(k, v), v) for k, v in want.items() if k != "hashing"]
    pairs += [(f"hashing.{k}", hashing.get(k, v), v) for k, v in want["hashing"].items()]
    for name, got, expected in pairs:
        if got != expected or type(got) is not type(expected):
            source = COPIED_FROM.get(name)
            said = f"{source} is {show_value(expected)}" if source else f"expected {show_value(expected)}"
            raise ValueError(f"field '{name}' is {show_value(got)}, {said}")


def _check_info(info) -> dict:
    """`info` (training figures) is an object; `workflows`, which a server compares its retrains
    with, is an integer >= 0 when present."""
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise ValueError(f"field 'info': expected an object, got {show_value(info)}")
    n = info.get("workflows", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"field 'info.workflows': expected an integer >= 0, got {show_value(n)}")
    return info


def _check_temperatures(temp, horizon: int) -> None:
    """`temperature.agent` and `temperature.continue` each hold `horizon` numbers in `TEMPERATURES`
    (the logits of step k are divided by the k-th): raise ValueError naming the field and the value."""
    if not isinstance(temp, dict):
        raise ValueError(f"field 'temperature': expected an object with 'agent' and 'continue', got {temp!r}")
    for key in ("agent", "continue"):
        values = temp.get(key)
        if not (isinstance(values, list) and len(values) == horizon and all(map(_temperature, values))):
            low, high = TEMPERATURES
            raise ValueError(f"field 'temperature.{key}': expected {horizon} numbers from {low:g} to {high:g}, "
                             f"got {values!r}")


def _temperature(v) -> bool:
    low, high = TEMPERATURES
    return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high
