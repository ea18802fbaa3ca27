"""Connection limits that aiohttp lacks: a deadline for a request's headers and a cap on open connections.

aiohttp's keep-alive timeout closes a connection that has no request in progress (from its opening and after
each response), which is the idle timeout; but a client that trickles a header line every few seconds
(slowloris) keeps a socket forever below that, and nothing bounds how many sockets are open. Here a request
whose headers are not complete `header_timeout_s` after its first byte gets a 408 and the connection closes,
and a connection beyond `max_connections` gets a 503 and is closed at once. WebSockets count as connections
but, once upgraded, are bounded by their heartbeat instead.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestHandler

from serving.errors import ApiError


class _Connection(RequestHandler):
    """One client connection, refused over the cap and closed when a request's headers take too long."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self._manager
        if len(server.connections) > server.max_connections:
            self._refuse(ApiError(503, "too_many_connections", f"the server already holds its maximum of "
                                  f"{server.max_connections} connections; retry shortly", retry_after=1))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_request():  # part of a request's head has arrived, not all of it
            if data and self._header_timer is None:
                self._header_timer = self._loop.call_later(self._manager.header_timeout_s, self._header_timeout)
        elif self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _awaiting_request(self) -> bool:
        """Between requests: the handler loop waits for the parser's next complete request head."""
        return self._waiter is not None and not self._waiter.done()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_request():
            timeout = self._manager.header_timeout_s
            self._refuse(ApiError(408, "header_timeout", f"headers: not complete within {timeout:g} s", "headers"))

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own answers (a malformed request line or header, an unsupported Content-Encoding, a
        crash outside the app) in the server's JSON error shape; only a 5xx is logged with its traceback, so
        hostile input cannot flood the log."""
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            err = ApiError(status, "internal_error", "internal server error")
        else:
            self.log_debug("Refused a malformed request from %s", request.remote, exc_info=exc)
            name = "Content-Encoding" if isinstance(exc, ContentEncodingError) else "headers"
            err = ApiError(status, "invalid_request", f"{name}: {(message or HTTPStatus(status).phrase)[:200]}",
                           name)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; the connection is broken")
        resp = web.json_response(err.body(), status=status)
        resp.force_close()
        return resp

    def _refuse(self, err: ApiError) -> None:
        """Answer without a request object (there is none yet), then close."""
        body = json.dumps(err.body()).encode()
        head = [f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{name}: {value}" for name, value in err.headers().items()]
        if self.transport is not None:
            self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        self.force_close()


class _Server(web.Server):
    def __init__(self, *args, header_timeout_s: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, **self._kwargs)


class LimitedAppRunner(web.AppRunner):
    """`web.AppRunner` with a header timeout, an idle timeout (aiohttp's keep-alive timeout) and a cap on
    open connections."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, idle_timeout_s: float,
                 max_connections: int, **kwargs):
        super().__init__(app, keepalive_timeout=idle_timeout_s, **kwargs)
        self._limits = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}

    def site(self, host: str, port: int) -> web.TCPSite:
        """The listening socket, its backlog as deep as the connections the server takes: the kernel queues a
        burst of that many until the event loop accepts them. With aiohttp's default of 128 it dropped the rest,
        whose clients retried a second later (TCP's SYN timeout), their first audio a second late."""
        return web.TCPSite(self, host, port, backlog=self._limits["max_connections"])

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup and its handler's arguments
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, loop=asyncio.get_running_loop(),
                       **self._limits, **server._kwargs)
