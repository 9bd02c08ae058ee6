"""Request bodies (validated, strict types) and response bodies of the OpenAI-compatible API.

Requests: strict pydantic models, so `"max_tokens": "5"` or `"stream": 1` is a 400, not coerced;
`null` for the fields OpenAI documents as nullable (`temperature`, `top_p`, `n`, `stream`,
`echo`) is the default. Sampling parameters are checked against OpenAI's ranges (temperature 0..2, top_p in
(0, 1]); a `seed` may be any integer (mapped into the generator's range: `seed % 2**63`). Fields
OpenAI defines that this server does not act on are accepted and ignored where ignoring them
leaves the answer one the client asked for (`presence_penalty`, `user`, `tool_choice` "auto": the
model may answer in text), as are unknown fields (clients such as LangChain send extras); where
it would not, the request is a 400 naming the field, not an answer of another shape: `logprobs` /
`top_logprobs` (no log probabilities are returned), `response_format` other than text (no
constrained decoding), `tool_choice` "required" or a named function and the legacy
`function_call` naming a function (no tool calls are parsed), `modalities` other than text and
`audio` (text answers only), a completion's `suffix` (no insertion), a non-empty `logit_bias`.
What tells chats apart is never dropped: `tools` / `functions` and each message's `name`,
`tool_calls` (validated: `{id, type: "function", function: {name, arguments: str}}`),
`tool_call_id` and legacy `function_call` reach the prompt (`Message.prompt_dict`,
`ChatRequest.prompt_tools`, rendered by `tokenizer.py`). The workflow hints `workflow_id`,
`agent`, `workflow_done` are what `openai`'s `extra_body` adds.
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


class FunctionCall(_Strict):
    name: str
    arguments: str          # JSON text, as the model wrote it (OpenAI's shape)


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None     # an assistant's calls of tools
    tool_call_id: Optional[str] = None              # a tool message: the call it answers
    function_call: Optional[FunctionCall] = None    # legacy (`functions`): an assistant's call

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _assistant_only(cls, v, info: ValidationInfo):
        if v and info.data.get("role") != "assistant":
            raise ValueError(f"only an assistant message may carry {info.field_name}")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def prompt_dict(self) -> dict:
        """The message as the prompt renders it (`tokenizer.Tokenizer.chat`): role and text, and
        each of `name`, `tool_calls`, `tool_call_id`, `function_call` that was sent (OpenAI's shapes)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.function_call is not None:
            out["function_call"] = self.function_call.model_dump()
        return out


class StreamOptions(_Strict):
    include_usage: bool = False


NULL_IS_DEFAULT = ("temperature", "top_p", "n", "stream", "echo")   # OpenAI documents these as nullable


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

    @field_validator(*NULL_IS_DEFAULT, mode="before", check_fields=False)   # echo: completions' own
    @classmethod
    def _null_is_default(cls, v, info: ValidationInfo):
        # `null` means "the default" (the openai client sends temperature=None as null)
        return cls.model_fields[info.field_name].default if v is None else v

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


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")   # description, parameters, strict: kept as sent
    name: str = Field(min_length=1)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list[FunctionDef]] = None      # legacy form of `tools`
    function_call: Optional[Union[str, dict]] = None   # legacy form of `tool_choice`
    modalities: Optional[list[str]] = None
    audio: Optional[dict] = None

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

    @field_validator("function_call")
    @classmethod
    def _no_forced_function(cls, v):
        if v is not None and v not in ("auto", "none"):
            raise ValueError("this server parses no function calls: function_call may be 'auto' (the model "
                             "answers in text) or 'none', not a named function")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_answers(cls, v):
        if v is not None and any(m != "text" for m in v):
            raise ValueError("this server answers in text only: modalities may hold only 'text'")
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise ValueError("audio output is not supported by this server (text only); leave out audio")
        return v

    def prompt_tools(self) -> Optional[list[dict]]:
        """The function definitions the prompt renders (`tools`, or legacy `functions` in the
        same shape); None when there are none."""
        tools = [t.model_dump() for t in self.tools or []]
        tools += [{"type": "function", "function": f.model_dump()} for f in self.functions or []]
        return tools or None

    def wanted_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tokens_param(self) -> str:
        """The field that set `wanted_tokens()` (errors name the field the client sent)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion: text that follows the completion) is not supported by this "
                             "server, which only continues the prompt; leave out suffix")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("log probabilities are not returned by this server; leave out logprobs")
        return v

    @field_validator("prompt")
    @classmethod
    def _single(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):   # a batch: ["text"] or [[ids]]
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got a batch of {len(v)} prompts; "
                                 "send one request per prompt")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt must not be empty")
        return v

    def wanted_tokens(self) -> Optional[int]:
        return self.max_tokens

    def tokens_param(self) -> str:
        return "max_tokens"


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
