"""Per-request generation settings (`Sampling`) and the reasons a request ends.

A `Request` carries its own `Sampling` (None: every default below) and, for streaming, an
`on_token(request, token) -> bool` callback. The real engine (`pbkv.engine.hf`) honours them;
the simulator ignores them (its calls produce `output_length` tokens). At prefill the real
engine turns them into one decode state per running request (`hf/state.py` `Seq`) and picks
each token with `hf/sampling.py` `sample`:
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
