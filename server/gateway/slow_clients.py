"""Bounds on slow clients: how long a connection may take to send a request, and how many it may hold.

uvicorn (0.54) bounds idle keep-alive connections (`timeout_keep_alive`), the size of a request
head (`h11_max_incomplete_event_size`) and, with `limit_concurrency`, answers 503 once that many
connections or requests are open. It has no deadline for a request *head* (a client that sends one
header byte every few seconds keeps its connection forever: the keep-alive timer stops at the
first byte) and none for a request *body*. The gateway adds both:

    head  `HeadDeadlineH11Protocol`: the head must be complete `header_timeout_s` after the
          connection opens or the previous response ends, else the connection is closed.
    body  `BodyDeadlineMiddleware` (ASGI): the body must be complete `body_timeout_s` after the
          head, else the client gets 408 `request_timeout` and the connection is closed.

Settings (`server/gateway/settings.py`, `DIALSPEC_*`): header_timeout_s, body_timeout_s,
keep_alive_timeout_s, max_connections, max_header_bytes. A streamed response is not bounded by
any of these (generation may take minutes; the client only waits).
"""

from __future__ import annotations

import asyncio
import contextlib

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.gateway.errors import APIError


def uvicorn_limits(settings) -> dict:
    """uvicorn.Config keyword arguments for a GatewaySettings."""
    protocol = type(
        "HeadDeadlineH11Protocol", (HeadDeadlineH11Protocol,), {"head_timeout": settings.header_timeout_s}
    )
    return {
        "http": protocol,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "limit_concurrency": settings.max_connections,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
    }


class HeadDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module docstring).

    The timer is armed when the connection opens and when a response ends (before uvicorn looks at
    pipelined data, which may start the next request at once), and disarmed when a head has been
    parsed, which is when uvicorn creates the request's cycle."""

    head_timeout: float = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_seen = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %.0f s", self.head_timeout)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._cycle_seen:
            self._cycle_seen = self.cycle  # a new request's head has been parsed
            self._disarm_head_timer()

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm_head_timer()  # the connection is a WebSocket's now (the gateway has none)
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_head_timer()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


class _BodyTimedOut(Exception):
    pass


class BodyDeadlineMiddleware:
    """Pure ASGI: a request body must be complete within `seconds` of the head (see the module
    docstring). On expiry the middleware itself answers 408 with `Connection: close` (uvicorn then
    closes the connection, so the rest of the body is never read) and drops whatever the app sends
    after; reading past the body (waiting for a disconnect while streaming) is not bounded."""

    def __init__(self, app, *, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_complete = False
        timed_out = False

        async def receive_by_deadline():
            nonlocal body_complete, timed_out
            if body_complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                err = APIError(
                    408,
                    f"the request body did not arrive within {self.seconds:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
                await err.response()(scope, receive, send)
                raise _BodyTimedOut from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_complete = True
            return message

        async def send_unless_timed_out(message):
            if not timed_out:
                await send(message)

        with contextlib.suppress(_BodyTimedOut):  # the 408 has been sent
            await self.app(scope, receive_by_deadline, send_unless_timed_out)
