"""Connection limits: slow or idle clients cannot hold the server's connections for ever.

uvicorn bounds idle kept-alive connections (`timeout_keep_alive`) and the number of open
connections plus running requests (`limit_concurrency`: above it, new requests get 503); it
bounds neither how long a client may take to send its headers nor its body. Two small pieces
add that:
- `with_header_timeout(protocol)`: a subclass of uvicorn's HTTP protocol that closes a
  connection whose request headers are not complete `header_timeout` seconds after it opened
  (or, on a kept-alive connection, after the next request's first byte), answering 408 first;
- `BodyTimeout`: ASGI middleware; a request whose body is not complete `body_timeout` seconds
  after its headers gets a 408 (OpenAI error shape, `Connection: close`).
Invariant: a connection that is not idle-between-requests is either sending its headers
(bounded by the header timeout), sending its body (bounded by the body timeout) or waiting for
its answer (bounded by the engine, which the queue limit bounds).
"""

from __future__ import annotations

import asyncio
import json

from pbkv.serve.errors import INVALID, APIError, error_body


def _timeout_408() -> bytes:
    """The raw answer to headers that took too long (written before any ASGI app runs), in the
    OpenAI error shape like every other error."""
    body = json.dumps(error_body("The request headers took too long to arrive.", INVALID, None,
                                 "request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body)


TIMEOUT_408 = _timeout_408()


def with_header_timeout(base: type, seconds: float) -> type:
    """`base` (uvicorn's HttpToolsProtocol or H11Protocol) with a header read timeout."""

    class HeaderTimeoutProtocol(base):
        header_timeout = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            between = self.cycle is None or self.cycle.response_complete
            if between and (self._header_timer is None or self._armed_for is not self.cycle):
                self._arm()   # the first byte of a kept-alive connection's next request
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            """Wait `header_timeout` for headers after the current cycle (None: the first)."""
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._armed_for = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired, self.cycle)

        def _expired(self, cycle) -> None:
            """No request's headers completed since arming (uvicorn starts a new cycle on them)."""
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.write(TIMEOUT_408)
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


class BodyTimeout:
    """Pure ASGI middleware: the request body must arrive within `seconds` of the headers.

    Only reads of the body are timed; once it is complete, further `receive()` calls (the wait
    for a client disconnect during an answer) are not."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, body_done = loop.time() + self.seconds, False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise APIError(408, f"The request body did not arrive within {self.seconds:g} seconds.",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message
        await self.app(scope, timed_receive, send)


def uvicorn_config(app, cfg, **kwargs):
    """uvicorn's Config for `app` with `cfg`'s (a ServeConfig) connection limits."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return uvicorn.Config(app, http=with_header_timeout(AutoHTTPProtocol, cfg.header_timeout),
                          timeout_keep_alive=cfg.keep_alive, limit_concurrency=cfg.max_connections,
                          timeout_graceful_shutdown=5, **kwargs)
