"""Per-request generation settings and how the real engine picks each output token.

A `Request` carries its own `Sampling` (None: every default below) and, for streaming, an
`on_token(request, token) -> bool` callback. The engine turns them into one decode state per
running request (`Seq`, state.py) at prefill:
- temperature: the request's, else `EngineOptions.temperature`; 0 is greedy (argmax);
- seed: the request's, else a hash of (`EngineOptions.seed`, workflow id, step), so a replay is
  reproducible and independent of what was cached; the generator lives on the model's device;
- top_p: softmax(logits / T) cut to the smallest set of most likely tokens whose mass reaches
  top_p (the most likely token is always kept);
- stop tokens: `stop_token_ids`, plus `EngineOptions.eos_token_ids` unless `ignore_eos`. A stop
  token ends the request with "stop" and is NOT part of its output (nor passed to `on_token`);
- `on_token` sees every other token right after it was appended to the output, in order; it
  returns True to end the request after that token ("stop": where stop strings are decided,
  since only the caller's detokenizer knows text);
- max_new_tokens: the request's, else its call's `output_length`; reaching it ends the request
  with "length". Admission reserves device space for exactly this many output tokens.

Finish reasons (`Request.finish_reason`, set once, right before `on_done`): "length", "stop",
"cancelled" (`HFEngine.cancel`), or whatever reason a caller passes to `cancel` (the server
uses "error").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LENGTH, STOP, CANCELLED, ERROR = "length", "stop", "cancelled", "error"


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int | None = None          # None: the call's output_length
    temperature: float | None = None           # None: the engine's default (EngineOptions)
    top_p: float = 1.0
    seed: int | None = None                    # None: derived from the engine seed and the call
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False                   # True: the engine's EOS ids do not stop it

    def __post_init__(self):
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


DEFAULT = Sampling()


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Greedy at temperature 0 (or without a generator); else softmax(logits / T) cut to the
    top-p nucleus, drawn with `gen` (on the logits' device).

    Total for every temperature > 0 and top_p in (0, 1], however small: the logits are shifted
    so their maximum is 0 before dividing (a tiny T sends the others to -inf, never the maximum
    to inf or NaN), and the most likely token is always in the nucleus. So tiny values behave
    like greedy instead of handing `multinomial` an invalid distribution."""
    if temperature <= 0 or gen is None:
        return int(torch.argmax(logits))
    shifted = logits.float() - logits.float().max()
    scaled = torch.nan_to_num(shifted / temperature, nan=0.0)   # 0 / T underflowing to 0 / 0 is the maximum
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        keep[0] = True                                         # the most likely token, whatever top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
