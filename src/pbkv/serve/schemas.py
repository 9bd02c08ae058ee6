"""Request bodies (validated, strict types) and response bodies of the OpenAI-compatible API.

Requests: strict pydantic models, so `"max_tokens": "5"` or `"stream": 1` is a 400, not coerced.
Sampling parameters are checked against OpenAI's ranges (temperature 0..2, top_p in (0, 1]); a
`seed` may be any integer (mapped into the generator's range: `seed % 2**63`). Fields OpenAI
defines that this server does not act on are accepted and ignored where ignoring them leaves the
answer one the client asked for (`presence_penalty`, `user`, `tools` with `tool_choice` "auto":
the model may answer in text), as are unknown fields (clients such as LangChain send extras);
where it would not, the request is a 400 naming the field, not an answer of another shape:
`logprobs` / `top_logprobs` (no log probabilities are returned), `response_format` other than
text (no constrained decoding), `tool_choice` "required" or a named function (no tool calls are
parsed), a non-empty `logit_bias`. The workflow hints `workflow_id`, `agent`, `workflow_done` are
what `openai`'s `extra_body` adds.
Responses: plain dicts in the exact shapes of `chat.completion`, `chat.completion.chunk` and
`text_completion` (the `openai` client parses them into its own types).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pbkv.engine.request import HIT_TIERS

MAX_STOP = 4          # OpenAI's limit on stop sequences
MAX_HINT_CHARS = 256  # workflow ids and agent names are labels, not payloads
SEED_RANGE = 2**63    # torch.Generator.manual_seed takes 64-bit seeds; any integer maps into [0, 2**63)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    ignore_eos: bool = False   # an extension (as in vLLM): generate max_tokens even past EOS
    # workflow hints (also accepted as headers X-Workflow-Id / X-Agent)
    workflow_id: Optional[str] = Field(None, min_length=1, max_length=MAX_HINT_CHARS)
    agent: Optional[str] = Field(None, min_length=1, max_length=MAX_HINT_CHARS)
    workflow_done: bool = False
    logit_bias: Optional[dict[str, Union[int, float]]] = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server; leave it out")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stream_options")
    @classmethod
    def _streamed_only(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):   # as OpenAI's API: a 400, not ignored
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: Optional[int]) -> Optional[int]:
        return None if v is None else v % SEED_RANGE   # equal seeds stay equal, any size is fine

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")   # json_schema's body is not read: only its type
    type: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tool_choice: Optional[Union[str, dict]] = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("log probabilities are not returned by this server; leave out logprobs "
                             "and top_logprobs")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.type != "text":
            raise ValueError(f"response_format {v.type!r} is not supported (no constrained decoding); "
                             "only 'text'")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_forced_tools(cls, v):
        if v is not None and v not in ("auto", "none"):
            raise ValueError("this server parses no tool calls: tool_choice may be 'auto' (the model "
                             "answers in text) or 'none', not a required or named tool")
        return v

    def wanted_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    logprobs: Optional[int] = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("log probabilities are not returned by this server; leave out logprobs")
        return v

    @field_validator("prompt")
    @classmethod
    def _single(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt must not be empty")
        return v

    def wanted_tokens(self) -> Optional[int]:
        return self.max_tokens


# ---------------------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


TIERS = HIT_TIERS


def usage(prompt: int, completion: int, cached: dict[str, int] | None = None) -> dict:
    """OpenAI's usage object with `prompt_tokens_details.cached_tokens` (prompt tokens whose KV
    came from a cache tier, as vLLM reports it) and the per-tier split in `pbkv_cached_tokens`."""
    tiers = {t: int((cached or {}).get(t, 0)) for t in TIERS}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(tiers.values())}, "pbkv_cached_tokens": tiers}


def chat_response(rid: str, model: str, text: str, finish: str, prompt: int, completion: int,
                  cached: dict[str, int] | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt, completion, cached)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: Optional[str] = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_response(rid: str, model: str, text: str, finish: str, prompt: int, completion: int,
                        cached: dict[str, int] | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt, completion, cached)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: Optional[str] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt: int, completion: int,
                cached: dict[str, int] | None = None) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt, completion, cached)}


def model_object(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "pbkv"}


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, created)]}
