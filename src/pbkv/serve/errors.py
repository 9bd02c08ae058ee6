"""OpenAI-style errors: every failure a client can cause becomes one JSON shape and a 4xx status.

Shape (what the `openai` client parses into `APIStatusError.body`):

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Invariant: a request can never make the server answer with a stack trace or a 500 for a mistake of
its own; `APIError` is raised for those and turned into this shape by one exception handler.
Answers given outside the routes (the connection limit, graceful shutdown, bytes uvicorn cannot
parse) use the same shape: `send_error` writes an `APIError` as ASGI messages, `raw_response` as
the bytes of a whole HTTP/1.1 response (for a protocol that answers before any app runs).
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus

INVALID = "invalid_request_error"


class APIError(Exception):
    """A request the server refuses; `status` is the HTTP status (4xx for client mistakes)."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID, param, code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves {served!r}.",
                    INVALID, "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    INVALID, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.", INVALID, None,
                    "request_too_large")


def overloaded(depth: int) -> APIError:
    return APIError(429, f"The server has {depth} requests queued (its limit); retry later.",
                    "rate_limit_error", None, "queue_full", headers={"Retry-After": "1"})


def too_many_connections() -> APIError:
    return APIError(503, "The server has as many open connections as it allows; retry later.", "server_error",
                    None, "too_many_connections", headers={"Retry-After": "1", "Connection": "close"})


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and stopped this request before answering it; retry "
                    "later.", "server_error", None, "server_shutting_down", headers={"Connection": "close"})


def stream_cut() -> APIError:
    """The last event of a stream that graceful shutdown's timeout cut short."""
    return APIError(503, "The server is shutting down and cut this stream before it finished; retry later.",
                    "server_error", None, "server_shutting_down")


def invalid_http() -> APIError:
    return APIError(400, "The request is not valid HTTP/1.1 (its request line, headers or body framing).",
                    INVALID, None, "invalid_http_request", headers={"Connection": "close"})


def _encoded(err: APIError) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """`err`'s JSON body and its headers (lower-case names, as ASGI servers compare them)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return body, headers + [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]


async def send_error(send, err: APIError) -> None:
    """Answer `err` through an ASGI `send` (no response may have started on it)."""
    body, headers = _encoded(err)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def raw_response(err: APIError) -> bytes:
    """`err` as a whole HTTP/1.1 response, to write on a connection that no app answers."""
    body, headers = _encoded(err)
    head = b"HTTP/1.1 %d %s\r\n" % (err.status, HTTPStatus(err.status).phrase.encode())
    return head + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*)$")  # pydantic's union-branch names


def pydantic_errors(exc) -> APIError:
    """The first validation error of a pydantic `ValidationError`, with its field path as `param`.
    A union field (`content`: a string or a list of parts) fails once per branch, the first
    branch's error first: the deepest error of that field is the one that says what is wrong (an
    image part's `type`, not "should be a valid string")."""
    errors = exc.errors()
    field = tuple(errors[0].get("loc", ()))[:1]
    err = max((e for e in errors if tuple(e.get("loc", ()))[:1] == field), key=lambda e: len(e.get("loc", ())))
    loc = [str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and _TYPE_TAG.match(p))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    where = f" at '{param}'" if param else ""
    code = "missing_required_parameter" if err.get("type") == "missing" else "invalid_value"
    return bad_request(f"Invalid request{where}: {msg}.", param, code)
