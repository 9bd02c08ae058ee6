"""Connection limits: slow or idle clients cannot hold the server's connections for ever.

uvicorn bounds idle kept-alive connections (`timeout_keep_alive`) and the number of open
connections plus running requests (`limit_concurrency`); it bounds neither how long a client may
take to send its headers nor its body, and the few answers it gives itself are plain text. Small
pieces add what is missing:
- `with_header_timeout(protocol)`: a subclass of uvicorn's HTTP protocol that closes a
  connection whose request headers are not complete `header_timeout` seconds after it opened
  (or, on a kept-alive connection, after the next request's first byte), answering 408 first;
- `BodyTimeout`: ASGI middleware; a request whose body is not complete `body_timeout` seconds
  after its headers gets a 408 (OpenAI error shape, `Connection: close`);
- `with_json_errors(protocol)`: a subclass whose own answers are the OpenAI error shape too: a
  request over `limit_concurrency` (--max-connections) gets 503 `too_many_connections` with
  `Retry-After` (`ConnectionLimit`, which replaces uvicorn's check), bytes it cannot parse as
  HTTP get 400 `invalid_http_request`.
Invariant: a connection that is not idle-between-requests is either sending its headers
(bounded by the header timeout), sending its body (bounded by the body timeout) or waiting for
its answer (bounded by the engine, which the queue limit bounds).
"""

from __future__ import annotations

import asyncio
import logging

from pbkv.serve.errors import APIError, invalid_http, raw_response, send_error, too_many_connections

log = logging.getLogger("pbkv.serve")
TIMEOUT_408 = raw_response(APIError(408, "The request headers took too long to arrive.", code="request_timeout",
                                    headers={"Connection": "close"}))
INVALID_400 = raw_response(invalid_http())


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


class ConnectionLimit:
    """ASGI wrapper of one connection's app: uvicorn's `limit_concurrency` check, answered in the
    OpenAI shape (503 `too_many_connections`, `Retry-After: 1`, `Connection: close`).

    It counts what uvicorn counts (its server-wide sets of open connections and request tasks):
    a request is refused when `limit` connections are open, its own included, or `limit` other
    requests run. So at most `limit` requests run the app at once."""

    def __init__(self, app, limit: int, connections: set, tasks: set):
        self.app, self.limit, self.connections, self.tasks = app, limit, connections, tasks

    async def __call__(self, scope, receive, send):
        others = len(self.tasks) - 1   # uvicorn added this request's own task before starting it
        if len(self.connections) >= self.limit or others >= self.limit:
            log.warning("refused a request: %d connections open, %d other requests running (limit %d)",
                        len(self.connections), others, self.limit)
            return await send_error(send, too_many_connections())
        await self.app(scope, receive, send)


def with_json_errors(base: type) -> type:
    """`base` (a uvicorn HTTP protocol) answering its own errors in the OpenAI shape."""

    class JSONErrorsProtocol(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # uvicorn answers a request over its limit with a plain-text 503 before any app runs;
            # with its check off, ConnectionLimit makes the same decision and answers in JSON
            limit, self.limit_concurrency = self.limit_concurrency, None
            if limit is not None:
                self.app = ConnectionLimit(self.app, limit, self.connections, self.tasks)

        def send_400_response(self, msg: str) -> None:
            """Bytes that are not HTTP (`msg`: uvicorn's reason, logged by it): a JSON 400, then
            the connection closes. The app's answer to the request being parsed is dropped if it
            has not started (the client reads ours alone), cut short if it has."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:   # the app's answer is already going out: cut it short
                    self.transport.close()
                    return
                cycle.disconnected = True    # as uvicorn marks it once the connection is lost: the
                                             # app's answer to this request (if any) is dropped
            self.transport.write(INVALID_400)
            self.transport.close()

    JSONErrorsProtocol.__name__ = f"JSONErrors{base.__name__}"
    return JSONErrorsProtocol


def uvicorn_config(app, cfg, **kwargs):
    """uvicorn's Config for `app` with `cfg`'s (a ServeConfig) connection limits; every answer
    the protocol gives itself is the OpenAI error shape (`with_json_errors`)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    http = with_json_errors(with_header_timeout(AutoHTTPProtocol, cfg.header_timeout))
    return uvicorn.Config(app, http=http,
                          timeout_keep_alive=cfg.keep_alive, limit_concurrency=cfg.max_connections,
                          timeout_graceful_shutdown=5, **kwargs)
