"""Training the neural predictor on workflow traces.

One sample per call position s of every workflow: input = the agents of calls 0..s and call s's
context; targets for k = 1..K = the agent of call s+k (class; rare/unknown agents -> UNK) or END.
Loss = cross-entropy of each agent head over the samples where call s+k exists, plus binary
cross-entropy of each continuation head (call s+k exists | call s+k-1 exists) over the samples
where call s+k-1 exists; that product is the survival. Adam with cosine decay.

Regularisation for small traces: about a tenth of the workflows are also copied with one agent
renamed UNK (so an unknown agent behaves like an average one), and the fused model sees each
sample's context dropped half of the time (model.py).

Determinism: the same traces, arguments and seed give the same weights in any process
(torch.manual_seed, one torch thread, one seeded generator for shuffling, seeded copies, and a
sha1 split of workflows for the calibration slice). After training, one temperature per head and step is fitted on that held-out slice (NLL).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pbkv.predict.base import UNK, check_agent_names
from pbkv.predict.features import FeatureConfig, Featurizer
from pbkv.predict.markov import fit_markov_seqs
from pbkv.predict.model import ModelConfig, PredictorNet, transition_matrices
from pbkv.predict.predictor import NeuralPredictor
from pbkv.trace import Call, Trace

TEMPERATURES = np.exp(np.linspace(np.log(0.25), np.log(8.0), 81))


def _trace_list(traces: Trace | list[Trace]) -> list[Trace]:
    return [traces] if isinstance(traces, Trace) else list(traces)


def workflows_of(traces: Trace | list[Trace]) -> list[list[Call]]:
    return [calls for t in _trace_list(traces) for calls in t.workflows().values() if calls]


def known_agents(wfs: list[list[Call]], min_count: int = 3) -> list[str]:
    """Agents with at least `min_count` calls, by name; rarer ones are UNK so the UNK class is learned."""
    counts = Counter(c.agent for calls in wfs for c in calls if c.agent != UNK)
    return sorted(a for a, n in counts.items() if n >= min_count) or sorted(counts)


def build_samples(wfs: list[list[Call]], feat: Featurizer, horizon: int, hidden_fn=None):
    """(items, agent targets [N, K] with -1 where call s+k does not exist, continuation targets and
    mask [N, K], hiddens or None)."""
    items, tgt, cont, mask, hid = [], [], [], [], []
    for calls in wfs:
        agents = [c.agent for c in calls]
        n = len(calls)
        for s, call in enumerate(calls):
            items.append((agents[:s + 1], call.context))
            tgt.append([feat.cls(agents[s + k]) if s + k < n else -1 for k in range(1, horizon + 1)])
            cont.append([float(s + k < n) for k in range(1, horizon + 1)])
            mask.append([float(s + k - 1 < n) for k in range(1, horizon + 1)])
            if hidden_fn is not None:
                hid.append(hidden_fn(call))
    return items, np.array(tgt, dtype=np.int64).reshape(-1, horizon), np.array(cont, dtype=np.float32).reshape(
        -1, horizon), np.array(mask, dtype=np.float32).reshape(-1, horizon), (hid if hidden_fn else None)


def _calib_split(wfs: list[list[Call]], fraction: float, seed: int):
    if fraction <= 0 or len(wfs) < 10:
        return wfs, []

    def u(calls):  # uniform in [0, 1) from the workflow id, the same in every process
        return int(hashlib.sha1(f"{seed}:{calls[0].workflow_id}".encode()).hexdigest(), 16) / 16 ** 40
    cal = [w for w in wfs if u(w) < fraction] or [min(wfs, key=u)]
    ids = {id(w) for w in cal}
    return [w for w in wfs if id(w) not in ids], cal


def unknown_agent_copies(wfs: list[list[Call]], fraction: float, seed: int) -> list[list[Call]]:
    """Copies of about `fraction` of the workflows with one of their agents (uniformly chosen) renamed
    to UNK everywhere: the model learns what an unseen agent does from many agents' behaviour,
    not from the few calls of the rare agents alone (an unknown current agent then looks like an
    average agent, as in Markov's fallback, instead of like one rare agent)."""
    rng = random.Random(f"unk:{seed}")
    out = []
    for calls in wfs:
        if rng.random() < fraction:
            names = sorted({c.agent for c in calls})
            gone = names[rng.randrange(len(names))]
            out.append([replace(c, agent=UNK) if c.agent == gone else c for c in calls])
    return out


def _loss(net, x, tgt, cont, mask):
    a_logits, c_logits = net(x)
    loss = a_logits.new_zeros(())
    for k in range(tgt.shape[1]):
        # ignore_index instead of boolean indexing: same loss, much cheaper backward on CPU
        alive = int((tgt[:, k] >= 0).sum())
        if alive:
            loss = loss + F.cross_entropy(a_logits[:, k], tgt[:, k], ignore_index=-1, reduction="sum") / alive
        m = mask[:, k]
        if m.sum() > 0:
            bce = F.binary_cross_entropy_with_logits(c_logits[:, k], cont[:, k], reduction="none")
            loss = loss + (bce * m).sum() / m.sum()
    return loss


def fit_temperatures(a_logits: np.ndarray, c_logits: np.ndarray, tgt: np.ndarray, cont: np.ndarray,
                     mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step k, the temperature (grid search) minimising the NLL of the agent head over alive
    samples, and of the continuation head over masked samples; 1.0 where there is nothing to fit."""
    k_steps = tgt.shape[1]
    t_a, t_c = np.ones(k_steps), np.ones(k_steps)
    for k in range(k_steps):
        alive = tgt[:, k] >= 0
        if alive.any():
            z, y = a_logits[alive, k], tgt[alive, k]
            best = []
            for t in TEMPERATURES:
                zt = z / t
                lse = zt.max(1) + np.log(np.exp(zt - zt.max(1, keepdims=True)).sum(1))
                best.append((lse - zt[np.arange(len(y)), y]).mean())
            t_a[k] = TEMPERATURES[int(np.argmin(best))]
        m = mask[:, k] > 0
        if m.any():
            z, y = c_logits[m, k], cont[m, k]
            nll = [np.mean(np.logaddexp(0, -z / t) * y + np.logaddexp(0, z / t) * (1 - y)) for t in TEMPERATURES]
            t_c[k] = TEMPERATURES[int(np.argmin(nll))]
    return t_a, t_c


@dataclass
class TrainOptions:
    """Everything `train_predictor` takes besides variant/horizon/epochs/seed (all have defaults)."""

    dim: int = 32
    hidden: int = 64
    dropout: float = 0.1
    context_dropout: float = 0.5  # the history path must stand on its own; context adds to it
    context_dim: int = 0
    features: FeatureConfig | None = None
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.1
    min_count: int = 3          # agents with fewer training calls are UNK
    unk_fraction: float = 0.1   # workflows copied with one agent renamed UNK
    # epochs=None: about `target_steps` optimizer steps within 8..max_epochs epochs. Small traces
    # (under ~800 samples) hit max_epochs first; more did not help them. On 2,000 generated
    # workflows 1,250 steps (8-11 epochs) predict as well as 2,500 did (held-out top-1 at k = 1:
    # swe 0.777 both, dialogue 0.909 / 0.909, hover 0.940 / 0.942) in half the time.
    target_steps: int = 1250
    max_epochs: int = 200
    calib_fraction: float = 0.1  # workflows held out to fit the temperatures
    refit_below: int = 3000     # fewer samples: retrain on all workflows after calibrating
    hidden_fn: Callable[[Call], np.ndarray] | None = None  # context_dim > 0: the hidden state of a call


def _train_net(cfg: ModelConfig, feat: Featurizer, wfs: list[list[Call]], opt: TrainOptions, epochs: int | None,
               seed: int, tick: Callable[[int], None]) -> tuple[PredictorNet, dict]:
    adj = transition_matrices([[feat.tok(c.agent) for c in w] for w in wfs], feat.vocab_size, feat.start)
    torch.manual_seed(seed)
    net = PredictorNet(cfg, *adj)
    # the real workflows' samples come first, then the <unk> copies': training uses all of them,
    # the figures reported (samples, train-set top-1) count the real ones only
    real = sum(map(len, wfs))
    items, tgt, cont, mask, hid = build_samples(wfs + unknown_agent_copies(wfs, opt.unk_fraction, seed), feat,
                                                cfg.horizon, opt.hidden_fn)
    x = NeuralPredictor(net, feat.agents).tensors(items, hid)
    tgt_t, cont_t, mask_t = map(torch.from_numpy, (tgt, cont, mask))
    n = len(items)
    per_epoch = math.ceil(n / opt.batch_size)
    epochs = epochs or max(8, min(opt.max_epochs, math.ceil(opt.target_steps / per_epoch)))
    total = epochs * per_epoch
    adam = torch.optim.AdamW(net.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(adam, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))
    gen = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, opt.batch_size):
            idx = order[i:i + opt.batch_size]
            loss = _loss(net, {k: v[idx] for k, v in x.items()}, tgt_t[idx], cont_t[idx], mask_t[idx])
            adam.zero_grad()
            loss.backward()
            adam.step()
            sched.step()
            tick(total)
    net.eval()
    with torch.inference_mode():
        a_log = net({k: v[:real] for k, v in x.items()})[0][:, 0].argmax(-1).numpy()
    alive = tgt[:real, 0] >= 0
    top1 = float((a_log[alive] == tgt[:real][alive, 0]).mean()) if alive.any() else None
    return net, {"samples": real, "epochs": epochs, "steps": total, "train_top1_k1": top1}


def train_predictor(traces: Trace | list[Trace], variant: str = "fused", horizon: int = 3,
                    epochs: int | None = None, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, **options) -> NeuralPredictor:
    """Train a `NeuralPredictor` (module docstring); `options` are `TrainOptions` fields.

    The temperatures are fitted on a held-out slice of the workflows. With few samples (under
    `refit_below`) the network is then trained again on every workflow with the same recipe and
    keeps those temperatures: a small trace cannot spare a tenth of its workflows, and which
    tenth is held out would otherwise change the model a lot.

    Runs on one torch thread (restored after): this small model trains about as fast on one as
    on two, the result no longer depends on the machine's thread count, and a second process
    training beside it cannot oversubscribe the cores (which slowed training 30x).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_predictor(traces, variant, horizon, epochs, seed, progress, TrainOptions(**options))
    finally:
        torch.set_num_threads(threads)


def _train_predictor(traces, variant, horizon, epochs, seed, progress, opt: TrainOptions) -> NeuralPredictor:
    t0 = time.perf_counter()
    check_agent_names(_trace_list(traces))
    wfs = workflows_of(traces)
    if not wfs:
        files = [t.path for t in _trace_list(traces) if t.path]
        raise ValueError(f"{', '.join(files)}: no workflows to train on" if files else "no workflows to train on")
    agents = known_agents(wfs, opt.min_count)
    cfg = ModelConfig(n_agents=len(agents), horizon=horizon, variant=variant, dim=opt.dim, hidden=opt.hidden,
                      dropout=opt.dropout, context_dropout=opt.context_dropout, context_dim=opt.context_dim,
                      features=opt.features or FeatureConfig())
    feat = Featurizer(agents, cfg.features)
    fit_wfs, cal_wfs = _calib_split(wfs, opt.calib_fraction, seed)
    refit = bool(cal_wfs) and sum(map(len, wfs)) < opt.refit_below
    state = {"done": 0, "base": 0}  # steps done; steps of the finished runs

    def tick(total: int):
        state["done"] += 1
        if progress:  # before the refit run its length is estimated by the first run's
            ahead = total if refit and state["base"] == 0 else 0
            progress(state["done"], state["base"] + total + ahead)

    net, info = _train_net(cfg, feat, fit_wfs, opt, epochs, seed, tick)
    markov = fit_markov_seqs([[c.agent for c in w] for w in wfs], horizon)
    pred = NeuralPredictor(net, agents, markov=markov)
    if cal_wfs:
        c_items, c_tgt, c_cont, c_mask, c_hid = build_samples(cal_wfs, feat, horizon, opt.hidden_fn)
        t_agent, t_cont = fit_temperatures(*pred.logits(c_items, c_hid), c_tgt, c_cont, c_mask)
        if refit:
            state["base"] = state["done"]
            net, info = _train_net(cfg, feat, wfs, opt, info["epochs"], seed, tick)
        pred = NeuralPredictor(net, agents, t_agent, t_cont, markov)
    pred.info = {"workflows": len(wfs), **info, "calibration_workflows": len(cal_wfs), "refit": refit, "seed": seed,
                 "train_seconds": round(time.perf_counter() - t0, 3), "parameters": pred.num_parameters()}
    return pred
