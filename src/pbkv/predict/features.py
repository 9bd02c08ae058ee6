"""Turning (history, context) into the integer/float arrays the neural predictor reads.

Token ids (inputs): 0 = PAD, 1..A = known agents, A+1 = UNK, A+2 = START. Output classes: 0..A-1
= known agents, A = UNK (class = token - 1). An empty history is [START]: "the workflow just
started". Everything here is deterministic across processes: text features are hashed with
zlib.crc32 (Python's hash() is salted per process and would change the buckets).

Visit counts are thermometer-coded: a class visited c times turns on the indicators "visited >= j
times" for j = 0..min(c, max_count). Loop exits in agent workflows compare a count with a
threshold ("retry until N visits"), which one indicator expresses; a one-hot count would make the
model learn every count value separately (and generalise worse to rarely seen counts).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class FeatureConfig:
    """Everything that fixes the features; stored in config.json so loading rebuilds them exactly."""

    window: int = 32        # last agents attended to (START included while the history is short)
    max_count: int = 15     # visit counts and gaps are bucketed 0..max_count (gap max_count+1: never)
    max_step: int = 63      # step index bucket cap
    buckets: int = 4096     # hashed text feature buckets (index `buckets` is padding)
    max_chars: int = 4000   # context text cap: a huge context costs no more than this
    max_tokens: int = 256   # word tokens kept per text group
    head_tokens: int = 8    # leading tokens of each line get position-tagged features
    max_lines: int = 16     # lines considered for head features
    thermometer: bool = True  # visit counts as "visited >= j" indicators (else one-hot buckets)

    @property
    def groups(self) -> int:
        return 3  # first line, other lines, line heads


def text_features(text: str | None, cfg: FeatureConfig) -> list[list[int]]:
    """Hashed feature ids per group: [first-line uni+bigrams, other lines' uni+bigrams, line heads].

    The first line of a context is usually the task (the same at every call of a workflow) and the
    rest the latest message; separate bags keep the short, informative part from being averaged
    away by a long task statement. Head features ("token 0 of a line is '<INFO>'") mark the kind of
    message.
    """
    out: list[list[int]] = [[], [], []]
    if not text:
        return out
    lines = text[:cfg.max_chars].lower().split("\n")
    b = cfg.buckets
    rest: list[str] = []
    for i, line in enumerate(lines):
        toks = WORD.findall(line)
        if i < cfg.max_lines:
            heads = toks[:cfg.head_tokens]
            out[2].extend(zlib.crc32(f"h{j}|{t}".encode()) % b for j, t in enumerate(heads))
            out[2].extend(zlib.crc32(f"hb{j}|{t}|{u}".encode()) % b for j, (t, u) in enumerate(zip(heads, heads[1:])))
        if i == 0:
            out[0] = _ngrams(toks[:cfg.max_tokens], "a", b)
        elif len(rest) < cfg.max_tokens:
            rest.extend(toks[:cfg.max_tokens - len(rest)])
    out[1] = _ngrams(rest, "b", b)
    return out


def _ngrams(toks: list[str], salt: str, b: int) -> list[int]:
    """crc32("salt|t") per token and crc32("salt|t|u") per adjacent pair, mod b. Computed by
    continuing a running crc32 (crc32(y, crc32(x)) == crc32(x + y)): each byte is hashed once."""
    crc = zlib.crc32
    enc = [t.encode() for t in toks]
    start = crc(f"{salt}|".encode())
    pre = [crc(t, start) for t in enc]
    uni = [h % b for h in pre]
    bi = [crc(u, crc(b"|", h)) % b for h, u in zip(pre, enc[1:])]
    return uni + bi


class Featurizer:
    """Maps agent names to ids and builds batches of model inputs (numpy; the model makes tensors)."""

    def __init__(self, agents: list[str], cfg: FeatureConfig):
        self.agents, self.cfg = list(agents), cfg
        self.n = len(self.agents)
        self.token = {a: i + 1 for i, a in enumerate(self.agents)}
        self.unk, self.start = self.n + 1, self.n + 2

    @property
    def vocab_size(self) -> int:
        return self.n + 3

    def tok(self, agent: str) -> int:
        return self.token.get(agent, self.unk)

    def cls(self, agent: str) -> int:
        """Output class of an agent: its index, or UNK (= n) when unknown."""
        return self.token.get(agent, self.unk) - 1

    @property
    def state_size(self) -> int:
        """Rows of the summed state embedding table: count buckets, gap buckets, step buckets."""
        c, classes = self.cfg, self.n + 1
        return classes * (c.max_count + 1) + classes * (c.max_count + 2) + c.max_step + 1

    def history_row(self, history: list[str]):
        """(window tokens, state ids, dense floats). State ids index one table: per class its visit
        count bucket, per class its steps-since-last-visit bucket, and the step bucket."""
        c = self.cfg
        toks = [self.start] + [self.tok(a) for a in history]
        win = toks[-c.window:]
        hist = [0] * (c.window - len(win)) + win
        classes = self.n + 1
        counts = [0] * classes
        gaps = [c.max_count + 1] * classes  # "never seen"
        for age, t in enumerate(reversed(toks[1:])):
            k = t - 1
            counts[k] += 1
            if gaps[k] == c.max_count + 1:
                gaps[k] = min(age, c.max_count)
        off, m = classes * (c.max_count + 1), c.max_count
        if c.thermometer:
            # "visited >= j times" for every j <= count: loop exits compare counts with a threshold
            pad = self.state_size                # read once: a property, asked per entry it cost a call each
            state = [k * (m + 1) + j if j <= min(v, m) else pad for k, v in enumerate(counts)
                     for j in range(m + 1)]
        else:
            state = [k * (m + 1) + min(v, m) for k, v in enumerate(counts)]
        state += [off + k * (c.max_count + 2) + g for k, g in enumerate(gaps)]
        step = len(history)
        state.append(off + classes * (c.max_count + 2) + min(step, c.max_step))
        dense = [math.log1p(v) for v in counts] + [math.log1p(step)]
        return hist, state, dense

    def batch(self, items: list[tuple[list[str], str | None]], text: bool = True) -> dict[str, np.ndarray]:
        rows = [self.history_row(list(h)) for h, _ in items]
        out = {
            "hist": np.array([r[0] for r in rows], dtype=np.int64),
            "state": np.array([r[1] for r in rows], dtype=np.int64),
            "dense": np.array([r[2] for r in rows], dtype=np.float32),
        }
        if text:
            out["text"] = pad_text([text_features(ctx, self.cfg) for _, ctx in items], self.cfg)
        return out


def pad_text(feats: list[list[list[int]]], cfg: FeatureConfig) -> np.ndarray:
    """[N, groups, F] int64 padded with `cfg.buckets` (the EmbeddingBag padding index); F >= 1."""
    width = max([1] + [len(g) for f in feats for g in f])
    arr = np.full((len(feats), cfg.groups, width), cfg.buckets, dtype=np.int64)
    for i, f in enumerate(feats):
        for j, g in enumerate(f):
            arr[i, j, :len(g)] = g
    return arr
