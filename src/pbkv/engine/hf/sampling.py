"""How the real engine picks each output token from a request's resolved `Sampling`
(`pbkv.engine.sampling`: the settings, their defaults and the finish reasons)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Greedy at temperature 0 (or without a generator); else softmax(logits / T) cut to the
    top-p nucleus, drawn with `gen` (on the logits' device)."""
    if temperature <= 0 or gen is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p   # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
