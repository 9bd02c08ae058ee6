"""Text <-> token ids for the server, and incremental detokenizing with stop strings.

- `ByteTokenizer`: for models without a tokenizer (the built-in `tiny`): BOS 1, EOS 2, byte b is
  token b + 3; any other id decodes to the byte (id - 3) mod 256, so every generated id is text.
  Deterministic and lossless on encode: `decode(encode(s)) == s` for any string.
- `HFTokenizer`: a transformers tokenizer (e.g. the GGUF's for `smollm2`), with its chat template.
- A chat's messages carry more than role and text: `name`, an assistant's `tool_calls` (and the
  legacy `function_call`), a tool message's `tool_call_id`, and the request's `tools` (function
  definitions). All of them reach the prompt: two chats that differ in any of them are different
  prompts (else they would share KV and answers). `render_chat` writes them itself; a chat template
  gets them in the transformers/OpenAI shapes where it renders them (found out once per template
  and feature by rendering sentinels, the message's own text among them: a template that drops the
  text beside a field does not render that field), and whatever it would drop is written as text
  inside the message (`_fold`) or, for `tools`, inside the first message (`_with_tools_text`).
  What a message is given natively depends on that message alone, never on later ones, so each
  earlier turn renders the same in every later call of a workflow (its KV prefix is reused). A
  chat without those fields renders exactly as `apply_chat_template(messages)`. A chat the
  template refuses even with every field as text raises `ChatRefused` (a client error, HTTP 400).
- `Detokenizer`: feeds generated ids, hands out only text that can no longer change: a trailing
  incomplete UTF-8 sequence and a trailing piece that could still become a stop string are held
  back; when a stop string appears, the text ends right before it.
"""

from __future__ import annotations

import json
from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    eos_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


HEAD_FIELDS = ("name", "tool_call_id")                # written before a message's text
TAIL_FIELDS = ("tool_calls", "tool_call_ids", "function_call")   # written after it


class ChatRefused(ValueError):
    """The model's chat template refuses this chat even with every extra field written as text:
    the chat itself does not fit the template (e.g. a system message, or roles that do not
    alternate, for a template that allows neither)."""


def render_chat(messages: list[dict], tools: list[dict] | None = None) -> str:
    """A plain chat layout (role tags, one per message, then the assistant's turn). Each earlier
    turn renders the same in every later call, so a workflow's calls share their prefix. A
    message's `name` and `tool_call_id` go in its tag, its `tool_calls` / `function_call` after its
    text (as JSON), the request's `tools` in a first `<|tools|>` turn."""
    head = f"<|tools|>\n{_dumps(tools)}\n" if tools else ""
    return head + "".join(_turn(m) for m in messages) + "<|assistant|>\n"


def _turn(m: dict) -> str:
    tag = m["role"] + "".join(f" {k}={_dumps(m[k])}" for k in HEAD_FIELDS if m.get(k) is not None)
    body = [m["content"]] if m["content"] else []
    body += [f"{k}: {_dumps(m[k])}" for k in TAIL_FIELDS if m.get(k)]
    return f"<|{tag}|>\n" + "\n".join(body) + "\n"


def _fold(m: dict, fields) -> dict:
    """`m` with `fields` written as text inside its content (for a template that would drop them)."""
    fields = [k for k in fields if m.get(k) is not None and m.get(k) != []]
    if not fields:
        return m
    lines = [f"{k}: {_dumps(m[k])}" for k in HEAD_FIELDS if k in fields]
    lines += [m["content"]] if m["content"] else []
    lines += [f"{k}: {_dumps(m[k])}" for k in TAIL_FIELDS if k in fields]
    out = {k: v for k, v in m.items() if k not in fields}
    out["content"] = "\n".join(lines)
    return out


def _with_tools_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`tools` written as text into the FIRST message: after a system message's text, else before
    the first message's text. No message is added (a template that refuses a system message, or
    anything but alternating user/assistant turns, takes the chat as it took it without tools);
    the JSON tells any two tools lists apart."""
    text = "Tools (function definitions, JSON): " + _dumps(tools)
    first = dict(messages[0])
    content = first["content"]
    first["content"] = (text if not content else f"{content}\n\n{text}" if first["role"] == "system"
                        else f"{text}\n\n{content}")
    return [first] + messages[1:]


def _template_arguments(arguments):
    """A tool call's `arguments` for a template: transformers' templates take a JSON object
    (OpenAI sends its text); text that is not a JSON object stays text."""
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return arguments
    return value if isinstance(value, dict) else arguments


PROBE = "pbkv_probe_5e1"   # sentinels: a field is rendered when its sentinel shows in the text
# call ids shaped like real ones (Mistral v0.3's template raises unless an id is 9 alphanumerics)
IDS = {"callid": "Pb7Kq2Zx9", "answers": "Pb4Wm8Rt3", "id1": "Pb5Jn6Hc1", "id2": "Pb5Jn6Hc2"}


class ByteTokenizer:
    BOS, EOS, OFFSET = 1, 2, 3

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"a byte tokenizer needs a vocabulary of >= {256 + self.OFFSET} ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_ids = frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes((i - self.OFFSET) % 256 for i in ids if i >= self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return [self.BOS] + self.encode(render_chat(messages, tools))


class HFTokenizer:
    """A transformers tokenizer; its chat template when it has one, else `render_chat`."""

    def __init__(self, tok, vocab_size: int | None = None):
        self.tok = tok
        self.vocab_size = vocab_size or len(tok)
        eos = tok.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else list(eos or []))
        self._probed: dict[tuple, bool] = {}   # (template, feature) -> whether it renders it

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text: `render_chat` for a tokenizer without a chat template; else the
        template's, each message given the fields the template renders and the others folded into
        its text (`_for_template`, decided per message: earlier turns render the same in every later
        call), `tools` the template does not render in the first message's text. A chat without
        extra fields is exactly `apply_chat_template(messages, add_generation_prompt=True)`.
        The template is the one transformers would pick for this call (`_template`: a tokenizer
        with several, e.g. `default` and `tool_use`, picks by whether `tools` is given); probes and
        render both use it. Should the template still raise, a message's folded `name` /
        `tool_call_id` are also given natively (a template may require them, e.g. Mistral v0.3 a
        tool message's `tool_call_id`), then every field goes as text only (that call's turns may
        then render unlike other calls'); should it raise on that too with the template's own
        `raise_exception`, the chat itself is what it refuses: `ChatRefused` (the template's
        message). Any other error (an undefined variable such as a missing `bos_token`, a syntax
        error) is the server's template being broken and propagates (HTTP 500)."""
        if not getattr(self.tok, "chat_template", None):
            return render_chat(messages, tools)
        template = self._template(tools)
        error, tried = None, []
        for chat, chat_tools in self._tries(messages, tools, template):   # built one by one: most calls need one
            if (chat, chat_tools) in tried:
                continue
            tried.append((chat, chat_tools))
            try:
                return self._apply(chat, chat_tools, template)
            except Exception as e:  # noqa: BLE001 - the template (foreign code) refused a field's shape
                error = e
        from jinja2 import TemplateError
        if type(error) is TemplateError:   # exactly what transformers' `raise_exception` raises
            said = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ChatRefused(f"the model's chat template refuses this chat: {said}") from error
        raise error   # not the template refusing the chat (a broken template): a server error

    def _tries(self, messages: list[dict], tools: list[dict] | None, template: str):
        """The chats `render` tries in turn, each with the tools given natively (or None)."""
        native_tools = tools if tools and self._renders(template, "tools") else None
        for keep in (False, True):
            chat = [self._for_template(m, template, keep) for m in messages]
            yield (_with_tools_text(chat, tools) if tools and native_tools is None else chat), native_tools
        plain = [_fold(m, HEAD_FIELDS + TAIL_FIELDS) for m in messages]
        yield (_with_tools_text(plain, tools) if tools else plain), None

    def _template(self, tools: list[dict] | None) -> str:
        """The template string `apply_chat_template(..., tools=tools)` would use (a tokenizer may
        hold several by name: `tool_use` when tools are given, else `default`)."""
        return self.tok.get_chat_template(None, tools)   # every transformers the project allows has it

    def _apply(self, messages: list[dict], tools: list[dict] | None, template: str) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                            add_generation_prompt=True, tokenize=False)

    def _for_template(self, m: dict, template: str, keep: bool = False) -> dict:
        """`m` for the template, decided from `m` alone (never from other messages): each field the
        template renders for a message like it (a `name` per role; one tool call, or several) in
        transformers' shapes, the rest folded into its text; with `keep`, a folded `name` /
        `tool_call_id` is given natively as well (for a template that requires it)."""
        fold = ["function_call"]
        if m.get("name") is not None and not self._renders(template, ("name", m["role"])):
            fold.append("name")
        if m.get("tool_call_id") is not None and not self._renders(template, "tool_call_id"):
            fold.append("tool_call_id")
        calls = m.get("tool_calls")
        if calls:
            feature = "tool_calls" if len(calls) == 1 else "tool_calls_multi"
            # a template that drops the text beside a call (Mistral v0.3, Llama-3.1) still gets the
            # call natively when the message has no text and nothing else would be folded into it
            bare = (not m["content"] and not [k for k in fold if m.get(k) is not None]
                    and self._renders(template, feature + "_bare") and self._renders(template, "tool_call_ids"))
            if not bare and not self._renders(template, feature):
                fold.append("tool_calls")
            else:
                m = dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=_template_arguments(
                    c["function"]["arguments"]))) for c in calls])
                if not self._renders(template, "tool_call_ids"):
                    m["tool_call_ids"] = [c["id"] for c in calls]
                    fold.append("tool_call_ids")
        out = _fold(m, fold)
        if keep:
            out.update({k: m[k] for k in HEAD_FIELDS if k in fold and k in m})
        return out

    def _renders(self, template: str, feature) -> bool:
        """Whether `template` renders `feature` (a field, or ("name", role)): once per template."""
        key = (template, feature)
        if key not in self._probed:
            try:
                self._probed.update({(template, f): ok for f, ok in self._probe(template, feature).items()})
            except Exception:  # noqa: BLE001 - a template that cannot render the field does not render it
                self._probed[key] = False
            self._probed.setdefault(key, False)
        return self._probed[key]

    def _probe(self, template: str, feature) -> dict:
        """Renders sentinels: a feature counts as rendered only if its values AND the text of the
        message carrying it show (a template that writes a call and drops the text beside it would
        make chats differing in that text one prompt). The sentinels are shaped like real values
        (names plain identifiers, call ids 9 alphanumerics, the call's and the answered one
        distinct), so a strict template (Mistral v0.3 raises on any other id) renders them."""
        said = PROBE + "said"
        shows = lambda text, *marks: all(IDS.get(k, PROBE + k) in text for k in marks)  # noqa: E731
        apply = lambda chat, tools=None: self._apply(chat, tools, template)  # noqa: E731
        user = {"role": "user", "content": PROBE + "hi"}
        if feature == "tools":
            fn = {"name": PROBE + "fn", "description": PROBE + "doc",
                  "parameters": {"type": "object", "properties": {PROBE + "arg": {"type": "string"}}}}
            return {"tools": shows(apply([user], [{"type": "function", "function": fn}]), "fn", "arg", "hi")}
        if feature in ("tool_calls_multi", "tool_calls_multi_bare"):
            calls = [{"id": IDS[f"id{i}"], "type": "function",
                      "function": {"name": PROBE + f"fn{i}", "arguments": {"a": PROBE + f"val{i}"}}} for i in (1, 2)]
            text = apply([user, {"role": "assistant", "content": said, "tool_calls": calls}]
                         + [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls])
            return {"tool_calls_multi": shows(text, "fn1", "val1", "fn2", "val2", "said"),
                    "tool_calls_multi_bare": shows(text, "fn1", "val1", "fn2", "val2")}
        if feature in ("tool_calls", "tool_calls_bare", "tool_call_ids", "tool_call_id", ("name", "tool")):
            call = {"id": IDS["callid"], "type": "function",
                    "function": {"name": PROBE + "fn", "arguments": {PROBE + "arg": PROBE + "val"}}}
            text = apply([user, {"role": "assistant", "content": said, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": IDS["answers"], "name": PROBE + "toolname",
                           "content": PROBE + "result"}])
            return {"tool_calls": shows(text, "fn", "val", "said"), "tool_calls_bare": shows(text, "fn", "val"),
                    "tool_call_ids": shows(text, "callid"),
                    "tool_call_id": shows(text, "answers", "result"),
                    ("name", "tool"): shows(text, "toolname", "result")}
        role = feature[1]
        probed = {"role": role, "content": said, "name": PROBE + "name"}
        chat = [probed, user] if role in ("system", "developer") else [user, probed] if role != "user" else [probed]
        return {feature: shows(apply(chat), "name", "said")}


def tokenizer_for(hf_tokenizer, vocab_size: int) -> Tokenizer:
    return HFTokenizer(hf_tokenizer, vocab_size) if hf_tokenizer is not None else ByteTokenizer(vocab_size)


class Detokenizer:
    """Incremental text of one generation. `push(id)` returns the new stable text; `stopped` is
    True once a stop string was seen (the caller then stops generating); `finish()` returns what
    was held back (nothing after a stop)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0          # characters of the text handed out so far
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.text = self.tok.decode(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.text
        if self.stops:
            window = max(0, self.sent - max(map(len, self.stops)) + 1)
            hits = [p for s in self.stops if (p := text.find(s, window)) >= 0]
            if hits:
                self.stopped = True
                end = max(min(hits), self.sent)
                out, self.sent = text[self.sent:end], end
                return out
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1  # maybe the first bytes of a character that the next token completes
            end -= self._stop_prefix(text[self.sent:end])
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out

    def _stop_prefix(self, tail: str) -> int:
        """Length of the longest end of `tail` that begins some stop string (held back)."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if s.startswith(tail[-n:]):
                    best = n
                    break
        return best
