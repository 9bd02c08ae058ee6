"""Text <-> token ids for the server, and incremental detokenizing with stop strings.

- `ByteTokenizer`: for models without a tokenizer (the built-in `tiny`): BOS 1, EOS 2, byte b is
  token b + 3; any other id decodes to the byte (id - 3) mod 256, so every generated id is text.
  Deterministic and lossless on encode: `decode(encode(s)) == s` for any string.
- `HFTokenizer`: a transformers tokenizer (e.g. the GGUF's for `smollm2`), with its chat template.
- `Detokenizer`: feeds generated ids, hands out only text that can no longer change: a trailing
  incomplete UTF-8 sequence and a trailing piece that could still become a stop string are held
  back; when a stop string appears, the text ends right before it.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    eos_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat(self, messages: list[dict]) -> list[int]: ...


def render_chat(messages: list[dict]) -> str:
    """A plain chat layout (role tags, one per message, then the assistant's turn). Each earlier
    turn renders the same in every later call, so a workflow's calls share their prefix."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


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

    def chat(self, messages: list[dict]) -> list[int]:
        return [self.BOS] + self.encode(render_chat(messages))


class HFTokenizer:
    """A transformers tokenizer; its chat template when it has one, else `render_chat`."""

    def __init__(self, tok, vocab_size: int | None = None):
        self.tok = tok
        self.vocab_size = vocab_size or len(tok)
        eos = tok.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else list(eos or []))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def chat(self, messages: list[dict]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = render_chat(messages)
        return self.encode(text)


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
