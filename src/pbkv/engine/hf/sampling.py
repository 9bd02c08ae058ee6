"""How the real engine picks each output token from a request's resolved `Sampling`
(`pbkv.engine.sampling`: the settings, their defaults and the finish reasons)."""

from __future__ import annotations

import torch


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
