"""pbkv hints from Ray Serve LLM's OpenAI requests, for the router and for the replicas. No Ray here.

Ray Serve LLM's ingress calls the model deployment as `chat(body, raw_request_info)` (or
`completions(...)`): `body` is a ChatCompletionRequest / CompletionRequest (vLLM's pydantic
models), `raw_request_info` carries the HTTP headers as a dict. A router sees exactly those
objects as `PendingRequest.args`. From them:

- workflow hints, first found wins per field: the body's `kv_transfer_params` (what the pbkv
  vLLM connector reads), the body's top-level `workflow_id` / `agent` / `workflow_done` (what
  `pbkv serve` accepts; vLLM keeps unknown body fields as pydantic extras), the headers
  `X-Workflow-Id` / `X-Agent`. Malformed values are ignored (hints only steer), as in
  `pbkv.integrations.vllm.hints`;
- `hash_ids`: the router has no tokenizer, so a prompt is rendered to text (`prompt_text`) and
  cut into fixed-size character chunks whose hashes are chained (`TextChunks`): equal text
  prefixes give equal leading ids, in every process (blake2b, not Python's seeded `hash`). A
  replica reports the same ids for the prompts it served, so router and replicas agree as long
  as both use the same `TextChunks` (`pbkv.scale.llm` passes one value to both);
- token counts are estimates: `chars_per_token` characters a token.

A request without a `workflow_id` gives no `LLMCall` (Ray's default least-queue routing).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pbkv.integrations.vllm.hints import MAX_HINT_CHARS, hint_label  # noqa: F401  (re-exported)
from pbkv.route import RouteRequest
from pbkv.trace import DEFAULT_AGENT
HEADERS = {"workflow_id": "x-workflow-id", "agent": "x-agent"}


@dataclass(frozen=True)
class TextChunks:
    """Fixed-size character chunks of a rendered prompt, hashed in a chain.

    Invariant: `hash_ids(a)` is a prefix of `hash_ids(b)` whenever text `a` is a prefix of `b`
    (only whole chunks are hashed); ids are 63-bit non-negative ints, equal across processes.
    One chunk stands for `block_tokens` tokens in the replicas' reports."""

    chunk_chars: int = 64
    chars_per_token: int = 4

    def __post_init__(self):
        if self.chunk_chars < 1 or self.chars_per_token < 1 or self.chunk_chars < self.chars_per_token:
            raise ValueError(f"TextChunks needs chunk_chars >= chars_per_token >= 1, got {self}")

    @property
    def block_tokens(self) -> int:
        return self.chunk_chars // self.chars_per_token

    def tokens(self, text: str) -> int:
        return -(-len(text) // self.chars_per_token)

    def hash_ids(self, text: str) -> tuple[int, ...]:
        ids, prev = [], b""
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            chunk = text[start:start + self.chunk_chars].encode("utf-8", "surrogatepass")
            prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
            ids.append(int.from_bytes(prev, "little") >> 1)
        return tuple(ids)


@dataclass(frozen=True)
class LLMCall:
    """One hinted call: what the router places, and whether it ends its workflow."""

    route: RouteRequest
    done: bool


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:   # pydantic keeps unknown body fields in `model_extra`
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def _text(value: Any) -> str:
    """Message content as text: strings as they are, text parts joined, other parts as sorted JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "".join(_text(v) for v in value)
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        if isinstance(value.get("text"), str):
            return value["text"]
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def render_messages(messages: Iterable[Any]) -> str:
    """A chat as one string: per message its role, name, content and tool calls, in order."""
    parts = []
    for m in messages:
        if hasattr(m, "model_dump"):
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, Mapping):
            parts.append(f"<|?|>\n{_text(m)}\n")
            continue
        head = f"<|{m.get('role', '')}|>{m.get('name') or ''}"
        tools = m.get("tool_calls")
        tail = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        parts.append(f"{head}\n{_text(m.get('content'))}{tail}\n")
    return "".join(parts)


def prompt_text(body: Any) -> str | None:
    """The text a request's KV is computed over: a chat's messages rendered, or a completion's
    prompt (token ids as their decimal list); None when the body has neither."""
    messages = _field(body, "messages")
    if messages is not None:
        return render_messages(messages)
    prompt = _field(body, "prompt")
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(p, str) for p in prompt):
        return "\x1e".join(prompt)
    return json.dumps(prompt, default=str)


_label = hint_label   # one rule for a hint label, the connector's (an int of 5,000 digits raised here)


def _headers(info: Any) -> Mapping:
    headers = _field(info, "headers") if info is not None else None
    return {str(k).lower(): v for k, v in headers.items()} if isinstance(headers, Mapping) else {}


def hints_of(body: Any, info: Any = None) -> tuple[str | None, str, bool]:
    """(workflow_id, agent, workflow_done) from the body and the request's headers (see the
    module docstring for the order). Without a workflow id the call ends its own workflow."""
    params = _field(body, "kv_transfer_params")
    sources = [params if isinstance(params, Mapping) else {}, body, _headers(info)]
    found: dict[str, Any] = {}
    for key in ("workflow_id", "agent"):
        for i, src in enumerate(sources):
            value = _label(src.get(HEADERS[key]) if i == 2 else _field(src, key))
            if value is not None:
                found[key] = value
                break
    done = next((d for d in (_field(s, "workflow_done") for s in sources[:2]) if isinstance(d, bool)), None)
    wf = found.get("workflow_id")
    return wf, found.get("agent", DEFAULT_AGENT), (wf is None) if done is None else done


def llm_call(body: Any, info: Any = None, chunks: TextChunks = TextChunks()) -> LLMCall | None:
    """The hinted call in a Ray Serve LLM request, or None (no workflow id, or no prompt)."""
    workflow_id, agent, done = hints_of(body, info)
    text = prompt_text(body) if workflow_id is not None else None
    if text is None:
        return None
    out = _field(body, "max_completion_tokens") or _field(body, "max_tokens") or 0
    route = RouteRequest(workflow_id=workflow_id, agent=agent, hash_ids=chunks.hash_ids(text),
                         input_tokens=chunks.tokens(text), output_tokens=int(out) if isinstance(out, int) else 0)
    return LLMCall(route, done)


def find_llm_call(args: Iterable, kwargs: Mapping | None = None, chunks: TextChunks = TextChunks()) -> LLMCall | None:
    """`llm_call` for a handle call's arguments: the first with `messages` or `prompt` is the body,
    the argument after it (or the `raw_request_info` keyword) the header carrier."""
    values = list(args) + list((kwargs or {}).values())
    for i, value in enumerate(values):
        if isinstance(value, (str, bytes)) or prompt_text(value) is None:
            continue
        info = (kwargs or {}).get("raw_request_info", values[i + 1] if i + 1 < len(values) else None)
        return llm_call(value, info, chunks)
    return None


def connector_params(body: Any, call: LLMCall) -> dict:
    """The body's `kv_transfer_params` with the call's hints filled in, so the pbkv connector
    inside the replica sees hints that came as top-level fields or headers."""
    params = _field(body, "kv_transfer_params")
    params = dict(params) if isinstance(params, Mapping) else {}
    return params | {"workflow_id": call.route.workflow_id, "agent": call.route.agent, "workflow_done": call.done}
