"""Request guards: the API key, the body size limit, JSON parsing, and header hints.

- API key: `Authorization: Bearer <key>` compared with `hmac.compare_digest` (time independent of
  where the strings differ). Without `--api-key` every request is allowed (the server binds
  127.0.0.1 by default, so only local processes reach it).
- Body: refused with 413 when `Content-Length` or the bytes actually received exceed the limit
  (the body is read in chunks and never kept past the limit), 400 when it is not a JSON object.
"""

from __future__ import annotations

import hmac
import json

from starlette.requests import Request

from pbkv.serve.errors import bad_request, too_large, unauthorized
from pbkv.serve.schemas import MAX_HINT_CHARS


def check_api_key(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), api_key.encode())
    if scheme.lower() != "bearer" or not ok:
        raise unauthorized()


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request ({e}). Send a JSON object "
                          f"with 'Content-Type: application/json'.", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}.", None, "invalid_json")
    return data


def header_hint(request: Request, name: str) -> str | None:
    """A workflow hint header (`X-Workflow-Id`, `X-Agent`): None when absent, 400 when unusable."""
    value = request.headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_HINT_CHARS:
        raise bad_request(f"Header {name} must be 1 to {MAX_HINT_CHARS} characters.", name, "invalid_value")
    return value
