"""Request guards: the API key, the body size limit, JSON parsing, and header hints.

- API key: `Authorization: Bearer <key>` compared with `hmac.compare_digest` (time independent of
  where the strings differ). Without `--api-key` every request is allowed (the server binds
  127.0.0.1 by default, so only local processes reach it); an empty key is refused at start
  (`server.build_state`), never taken as "no key".
- Body (`read_body`, then `parse_json`): refused with 413 when `Content-Length` or the bytes
  actually received exceed the limit (the body is read in chunks and never kept past the limit),
  400 when it is not a JSON object, is nested deeper than `MAX_DEPTH`, or holds a string that is
  not valid Unicode (a lone surrogate such as "\ud800", which JSON escapes allow): every later
  step (pydantic, the tokenizer, the recorder) may then assume nested-but-bounded data and
  encodable text.
"""

from __future__ import annotations

import hmac
import json

from starlette.requests import Request

from pbkv.serve.errors import bad_request, too_large, unauthorized
from pbkv.serve.schemas import MAX_HINT_CHARS

MAX_DEPTH = 64   # OpenAI bodies nest a few levels (messages -> content parts); deeper is a mistake or an attack


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), api_key.encode())
    if scheme.lower() != "bearer" or not ok:
        raise unauthorized()


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, 413 past `limit` bytes (declared or received)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, checked by `check_json_tree`; 400 otherwise. CPU work of a size
    the client picks (tens of ms for 1 MB): the server runs it off the event loop."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request ({e}). Send a JSON object "
                          f"with 'Content-Type: application/json'.", None, "invalid_json") from None
    except RecursionError:  # the parser recursed once per level: far past MAX_DEPTH
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}.", None, "invalid_json")
    check_json_tree(data)
    return data


def _too_deep():
    return bad_request(f"The JSON body is nested deeper than {MAX_DEPTH} levels.", None, "invalid_json")


def check_json_tree(data: object) -> None:
    """400 unless `data` nests at most `MAX_DEPTH` levels and every string (keys included) is
    valid Unicode. Iterative (no recursion, whatever the depth); names the first bad string's path."""
    stack: list[tuple[object, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((item, path + (str(key),), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = ".".join(path) or None
        where = f" at '{param}'" if param else ""
        raise bad_request(f"Invalid request{where}: the text holds a lone surrogate ({text[e.start]!r} at "
                          f"character {e.start}); send valid Unicode (UTF-8).", param, "invalid_value") from None


def header_hint(request: Request, name: str) -> str | None:
    """A workflow hint header (`X-Workflow-Id`, `X-Agent`): None when absent, 400 when unusable.
    Read as UTF-8 (what clients send for a name such as "café", and how the body and the URL of
    `/v1/workflows/{id}/end` carry it), as Latin-1 only when the bytes are not UTF-8: the server
    hands headers over decoded as Latin-1, which would make "café" another workflow than the
    body's."""
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        value = value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        pass
    value = value.strip()
    if not value or len(value) > MAX_HINT_CHARS:
        raise bad_request(f"Header {name} must be 1 to {MAX_HINT_CHARS} characters.", name, "invalid_value")
    return value
