"""Prompts as real token ids (docs/trace-format.md, "Turning a trace into real tokens"), and back.

- `TokenMapper`: block id -> `block_size` token ids drawn from a generator seeded by the id (the
  last block of a prompt cut to the remaining length). Equal ids give equal tokens, and a cut
  block is a prefix of the full one, so prefix sharing in the trace is real prefix sharing.
- `block_hashes`: real token ids -> chained block ids (for prompts that come as tokens).
- `scale_trace`: every length divided by a factor, with the trace's prefix-sharing structure
  kept exactly (a real trace's 4-8k-token prompts are too slow for a 2-core CPU).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from pbkv.trace import Call, Trace, TraceMeta


class TokenMapper:
    """Deterministic block id -> token ids, in [low, vocab_size) (low ids are often special tokens)."""

    def __init__(self, vocab_size: int, block_size: int, seed: int = 0, low: int | None = None):
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed
        self.low = min(1024, vocab_size // 8) if low is None else low
        if not 0 <= self.low < vocab_size:
            raise ValueError(f"token range [{self.low}, {vocab_size}) is empty")
        self._blocks: dict[int, list[int]] = {}

    def block(self, block_id: int) -> list[int]:
        toks = self._blocks.get(block_id)
        if toks is None:
            if len(self._blocks) > 200_000:  # bound memory on long traces; regenerating is exact
                self._blocks.clear()
            rng = np.random.default_rng([self.seed, abs(block_id) % 2 ** 63, int(block_id < 0)])
            toks = self._blocks[block_id] = rng.integers(self.low, self.vocab_size, self.block_size).tolist()
        return toks

    def tokens(self, call: Call) -> list[int]:
        """The prompt of `call`: its blocks' tokens, the last block cut to `input_length`."""
        out: list[int] = []
        for block_id in call.hash_ids:
            out.extend(self.block(block_id))
        if len(out) < call.input_length:
            raise ValueError(f"call {call.workflow_id} step {call.step}: {len(call.hash_ids)} blocks of "
                             f"{self.block_size} cannot hold {call.input_length} tokens")
        return out[:call.input_length]


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained ids of a token sequence: id i names the content of blocks 0..i (a partial last
    block is its own content, so it never equals the full block that extends it)."""
    out, prev = [], b""
    for i in range(0, len(token_ids), block_size):
        data = prev + np.asarray(token_ids[i:i + block_size], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(data, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)  # non-negative, 63 bits
    return out


def scale_geometry(block_size: int, factor: float) -> tuple[int, int]:
    """(new block size, block stride) that divide lengths by about `factor`: blocks shrink first;
    past one token per block, only every `stride`-th block is kept (plus each prompt's last)."""
    if not factor >= 1:
        raise ValueError(f"--scale must be >= 1, got {factor}")
    per_block = block_size / factor
    if per_block >= 1:
        return max(1, round(per_block)), 1
    return 1, max(1, round(factor / block_size))


def scale_trace(trace: Trace, factor: float, output_factor: float | None = None) -> Trace:
    """A copy of `trace` with every prompt length divided by ~`factor` and every output length by
    `output_factor` (default: `factor`; a larger one makes a prefill-bound replay on a CPU).

    Kept exactly: which calls share which prefix (a kept block keeps its chained id, and chained
    ids stay chained under subsampling: id i still names the whole prefix up to it), workflows,
    agents, steps, times. Output lengths are rounded, never below 1 when they were positive."""
    bs, stride = scale_geometry(trace.block_size, factor)
    out_factor = factor if output_factor is None else output_factor
    if not out_factor >= 1:
        raise ValueError(f"--output-scale must be >= 1, got {out_factor}")
    if bs == trace.block_size and stride == 1 and out_factor == 1:
        return trace
    calls = []
    for c in trace.calls:
        n = len(c.hash_ids)
        if stride == 1:
            ids = list(c.hash_ids)
            tail = c.input_length - trace.block_size * (n - 1)
            length = bs * (n - 1) + min(bs, max(1, round(tail * bs / trace.block_size)))
        else:
            keep = list(range(stride - 1, n, stride))
            if not keep or keep[-1] != n - 1:
                keep.append(n - 1)  # the prompt's own end: where it diverges from its siblings
            ids = [c.hash_ids[i] for i in keep]
            length = len(ids)
        out = 0 if c.output_length == 0 else max(1, round(c.output_length / out_factor))
        calls.append(replace(c, input_length=length, output_length=out, hash_ids=ids, extra=dict(c.extra)))
    meta = TraceMeta(block_size=bs, source=trace.meta.source, license=trace.meta.license,
                     notes=f"scaled by {factor:g}, outputs by {out_factor:g} (block size {trace.block_size} -> {bs}, stride {stride})",
                     extra=dict(trace.meta.extra))
    return Trace(meta, calls, trace.path)
