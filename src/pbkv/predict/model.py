"""The neural predictor's network: graph + history + context encoders, fused by a small MLP.

Inputs are the arrays of `features.Featurizer.batch` as tensors. Outputs, in one shot for every
step k = 1..K: agent logits [N, K, A+1] (known agents, then UNK) and continuation logits [N, K]
(call s+k happens given call s+k-1 did). Survival is the running product of the continuation
probabilities, so it cannot increase with k.

Parts (switched by `variant`: "fused" = all, "history" = no context, "context" = context only):
- graph: the agent-transition graph of the training traces (row-normalised out- and in-transition
  matrices over START/agents/UNK, stored as buffers), encoded GraphSAGE-style: each layer maps
  [self, mean of out-neighbours, mean of in-neighbours] through a linear layer (residual, ReLU);
- history: the last `recent` agents in order (n-gram-like), multi-head attention over the last
  `window` agents (graph embedding + recency embedding) with the current agent as the query, a
  summed embedding of per-agent "visited >= j times" indicators, steps-since-last-visit buckets
  and the step bucket, and raw log1p counts (loops such as "retry until N visits" are decided by
  exact counts, see features.py);
- context: hashed word uni+bigrams -> EmbeddingBag(mean) per text group, or a linear projection
  of the serving model's hidden state when `context_dim > 0`. In training, a sample's whole
  context is dropped with probability `context_dropout` (fused variant only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from pbkv.predict.base import MAX_HORIZON
from pbkv.predict.features import FeatureConfig

VARIANTS = ("fused", "history", "context")
# Inclusive ranges of the integer fields. The upper bounds are far above any useful model; they
# keep a tampered config.json's sizes small enough for `MAX_NUMBERS` to be checked without overflow.
MODEL_RANGES = {"n_agents": (0, 100_000), "horizon": (1, MAX_HORIZON), "dim": (1, 4096), "hidden": (1, 65_536),
                "graph_layers": (0, 64), "heads": (1, 4096), "recent": (1, 4096), "context_dim": (0, 65_536)}
FEATURE_RANGES = {"window": (1, 4096), "max_count": (0, 4096), "max_step": (0, 1 << 20), "buckets": (1, 1 << 24),
                  "max_chars": (0, 1 << 30), "max_tokens": (0, 1 << 20), "head_tokens": (0, 1 << 20),
                  "max_lines": (0, 1 << 20)}
PROBABILITIES = ("dropout", "context_dropout")
MAX_NUMBERS = 1 << 28   # weights + buffers of one network (1 GiB of float32): default models hold ~0.3 M


@dataclass
class ModelConfig:
    """The network's shape. Invariants (checked on creation, so a hand-edited config.json is
    refused before anything is allocated, each error naming the field `model.NAME` and the
    value): integers are ints within `MODEL_RANGES` / `FEATURE_RANGES`, `dropout` and
    `context_dropout` numbers in [0, 1], `variant` one of `VARIANTS`, dim % heads == 0,
    recent <= features.window, and the network holds at most `MAX_NUMBERS` numbers."""

    n_agents: int
    horizon: int = 3
    variant: str = "fused"
    dim: int = 32
    hidden: int = 64
    graph_layers: int = 2
    heads: int = 4
    recent: int = 4  # last agents fed in order (<= features.window)
    dropout: float = 0.1
    context_dropout: float = 0.5  # training only: probability a sample's whole context is dropped
    context_dim: int = 0
    features: FeatureConfig = field(default_factory=FeatureConfig)

    def __post_init__(self):
        if isinstance(self.features, dict):
            self.features = _feature_config(self.features)
        if not isinstance(self.features, FeatureConfig):
            raise ValueError(f"field 'model.features': expected an object, got {self.features!r:.80}")
        _check_ints(self, MODEL_RANGES, "model")
        _check_ints(self.features, FEATURE_RANGES, "model.features")
        if not isinstance(self.features.thermometer, bool):
            raise ValueError(f"field 'model.features.thermometer': expected true or false, "
                             f"got {self.features.thermometer!r:.80}")
        for name in PROBABILITIES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"field 'model.{name}': expected a number from 0 to 1, got {v!r:.80}")
        if not isinstance(self.variant, str) or self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r:.80}; expected one of {', '.join(VARIANTS)}")
        if self.dim % self.heads or not 1 <= self.recent <= self.features.window:
            raise ValueError(f"need dim % heads == 0 and 1 <= recent <= window, got dim {self.dim}, "
                             f"heads {self.heads}, recent {self.recent}, window {self.features.window}")
        numbers = self.numbers()
        if numbers > MAX_NUMBERS:
            raise ValueError(f"field 'model': the network would hold {numbers:,} numbers, more than "
                             f"{MAX_NUMBERS:,} (dim {self.dim}, hidden {self.hidden}, buckets "
                             f"{self.features.buckets}, {self.n_agents} agents)")

    @classmethod
    def from_dict(cls, d) -> "ModelConfig":
        """A config from `to_dict`'s JSON (config.json's `model`); ValueError naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"field 'model': expected an object, got {d!r:.80}")
        _known_keys(d, cls, "model")
        if "n_agents" not in d:
            raise ValueError("field 'model.n_agents': missing")
        return cls(**d)

    def numbers(self) -> int:
        """Weights + buffers of `PredictorNet(self)`, computed without building it (a tampered
        size must be refused before anything is allocated; tests compare this count with the
        network's, so the two cannot drift apart)."""
        n, d, h, f = self.n_agents, self.dim, self.hidden, self.features
        vocab, classes, out = n + 3, n + 1, self.horizon * (n + 2)
        total, width = 2 * vocab * vocab, 0                      # adj_out, adj_in
        if self.uses_history:
            state = classes * (2 * f.max_count + 3) + f.max_step + 2
            total += (vocab + f.window + state) * d + self.graph_layers * (3 * d + 1) * d + 3 * d * (d + 1)
            width += (self.recent + 2) * d + classes + 1
        if self.uses_context:
            groups = f.groups * d
            total += (self.context_dim + 1) * groups if self.context_dim > 0 else (f.buckets + 1) * d
            width += groups
        return total + (width + 1) * h + (h + 1) * h + (h + 1) * out   # the MLP's two layers, the head

    @property
    def uses_history(self) -> bool:
        return self.variant in ("fused", "history")

    @property
    def uses_context(self) -> bool:
        return self.variant in ("fused", "context")

    def to_dict(self) -> dict:
        return asdict(self)


class PredictorNet(nn.Module):
    def __init__(self, cfg: ModelConfig, adj_out: torch.Tensor | None = None, adj_in: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        n, d, f = cfg.n_agents, cfg.dim, cfg.features
        vocab = n + 3
        self.register_buffer("adj_out", adj_out if adj_out is not None else torch.zeros(vocab, vocab))
        self.register_buffer("adj_in", adj_in if adj_in is not None else torch.zeros(vocab, vocab))
        width = 0
        if cfg.uses_history:
            classes = n + 1
            self.node = nn.Embedding(vocab, d)
            self.sage = nn.ModuleList(nn.Linear(3 * d, d) for _ in range(cfg.graph_layers))
            self.pos = nn.Embedding(f.window, d)
            self.qkv = nn.Linear(d, 3 * d)
            # one summed table for visit-count, gap and step buckets: one lookup per call (speed)
            size = classes * (2 * f.max_count + 3) + f.max_step + 1
            self.state = nn.EmbeddingBag(size + 1, d, mode="sum", padding_idx=size)
            # last `recent` agents (current included) in order, attention pooled, state, raw dense floats
            width += (cfg.recent + 2) * d + classes + 1
        if cfg.uses_context:
            if cfg.context_dim > 0:
                self.proj = nn.Linear(cfg.context_dim, f.groups * d)
            else:
                self.text = nn.EmbeddingBag(f.buckets + 1, d, mode="mean", padding_idx=f.buckets)
            width += f.groups * d
        h = cfg.hidden
        self.mlp = nn.Sequential(nn.Linear(width, h), nn.ReLU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(h, h), nn.ReLU(), nn.Dropout(cfg.dropout))
        self.head = nn.Linear(h, cfg.horizon * (n + 2))  # K x (agent logits, continuation logit)
        self._graph_cache: torch.Tensor | None = None

    def train(self, mode: bool = True):
        self._graph_cache = None  # embeddings change while training; recompute after
        return super().train(mode)

    def graph(self) -> torch.Tensor:
        """Node embeddings after the GraphSAGE layers, [vocab, dim] (cached in eval mode)."""
        if not self.training and self._graph_cache is not None:
            return self._graph_cache
        h = self.node.weight
        for layer in self.sage:
            h = h + torch.relu(layer(torch.cat([h, self.adj_out @ h, self.adj_in @ h], dim=-1)))
        if not self.training:
            self._graph_cache = h
        return h

    def _history(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        hist = x["hist"]
        n_batch, window = hist.shape
        # F.embedding, not g[hist]: its backward is a fast dense scatter, indexing's is slow on CPU
        e_hist = F.embedding(hist, self.graph())
        recent = e_hist[:, -cfg.recent:].reshape(n_batch, -1)  # exact order of the last few (n-gram-like)
        q, k, v = self.qkv(e_hist + self.pos.weight[None, :window]).chunk(3, dim=-1)
        heads, dh = cfg.heads, cfg.dim // cfg.heads
        q = q[:, -1].reshape(n_batch, heads, 1, dh)  # the query is the current agent (last slot)
        k = k.reshape(n_batch, window, heads, dh).transpose(1, 2)
        v = v.reshape(n_batch, window, heads, dh).transpose(1, 2)
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))  # [N, heads, 1, window]
        att = att.masked_fill((hist == 0)[:, None, None, :], float("-inf"))  # the last slot is never PAD
        pooled = (att.softmax(-1) @ v).reshape(n_batch, cfg.dim)
        return torch.cat([recent, pooled, self.state(x["state"]), x["dense"]], dim=-1)

    def _context(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        n_batch = x["hist"].shape[0]
        keep = None
        if self.training and self.cfg.context_dropout > 0 and self.cfg.uses_history:
            # drop a sample's whole context (as if it had none): the history path must stand on its
            # own and context only adds to it; small traces otherwise get memorised by their text
            keep = (torch.rand(n_batch, 1) >= self.cfg.context_dropout).float()
        if self.cfg.context_dim > 0:
            hid = x.get("hidden")
            hid = torch.zeros(n_batch, self.cfg.context_dim) if hid is None else hid
            return self.proj(hid if keep is None else hid * keep)
        text = x["text"]
        groups, width = text.shape[1:]
        bags = self.text(text.reshape(n_batch * groups, width)).reshape(n_batch, groups * self.cfg.dim)
        return bags if keep is None else bags * keep  # zeros = the bags of an empty context

    def forward(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        if self.cfg.uses_history:
            parts.append(self._history(x))
        if self.cfg.uses_context:
            parts.append(self._context(x))
        h = self.mlp(torch.cat(parts, dim=-1))
        out = self.head(h).view(-1, self.cfg.horizon, self.cfg.n_agents + 2)
        return out[:, :, :-1], out[:, :, -1]


def transition_matrices(seqs: list[list[int]], vocab: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-normalised out- and in-transition matrices over token ids from agent id sequences
    (START -> first, each agent -> next); rows without transitions stay zero (mean of nothing)."""
    c = torch.zeros(vocab, vocab, dtype=torch.float64)
    for s in seqs:
        for a, b in zip([start] + s, s):
            c[a, b] += 1
    out = c / c.sum(1, keepdim=True).clamp_min(1)
    inn = c.T / c.T.sum(1, keepdim=True).clamp_min(1)
    return out.float(), inn.float()


def _feature_config(d: dict) -> FeatureConfig:
    _known_keys(d, FeatureConfig, "model.features")
    return FeatureConfig(**d)


def _known_keys(d: dict, cls, where: str) -> None:
    unknown = sorted(set(d) - {f.name for f in fields(cls)}, key=str)
    if unknown:
        raise ValueError(f"field '{where}': unknown key {unknown[0]!r:.80}")


def _check_ints(obj, ranges: dict[str, tuple[int, int]], where: str) -> None:
    """Each field named in `ranges` is an int (not a bool: JSON true is no size) within its range."""
    for name, (low, high) in ranges.items():
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ValueError(f"field '{where}.{name}': expected an integer from {low:,} to {high:,}, got {v!r:.80}")
