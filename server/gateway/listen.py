"""How the gateway listens: the TCP socket (bound before models load) and the uvicorn server.

Binding first means a busy port fails in a second, not after the engine has loaded; the socket is
handed to uvicorn, whose startup prints the URL the moment it is listening.

While the engine loads (`StartingServer`), a minimal app on the same socket answers
/health 200 and everything else 503 `starting`, so an orchestrator's probe sees "not ready yet"
from the first second, never a refused connection.

Slow clients are bounded by `slow_clients.py`, with limits from the gateway's settings.

Shutdown (`GatewayServer`): the first SIGTERM or SIGINT starts the gateway's drain while the
listener stays open (new requests get 503, not refused connections); when the drain is over,
uvicorn closes the listener, the lifespan stops the engine, and the process exits 0. A second
signal exits at once (uvicorn's own handling). An engine fault shuts down the same way with exit
code 1, so that a supervisor restarts the server.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time

from fastapi.responses import JSONResponse

from server.cli_errors import CLIError
from server.gateway.errors import APIError
from server.gateway.slow_clients import uvicorn_limits


def tcp_socket(host: str) -> socket.socket:
    """A listening-socket candidate that uvicorn's connections will stream from without delay.

    The protocol must be named: asyncio sets TCP_NODELAY only on transports whose socket says
    IPPROTO_TCP, and with protocol 0 Nagle's algorithm holds small SSE writes back until the
    client's delayed ACK (~40 ms added to the first token on a reused connection).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def bind(host: str, port: int) -> socket.socket:
    """A bound socket, or a one-line CLIError saying what to change."""
    sock = tcp_socket(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise CLIError(
                f"port {port} on {host} is already in use; "
                "pick another with --port (or stop the other server)"
            ) from None
        if exc.errno == errno.EACCES:
            raise CLIError(f"no permission to bind port {port}; use a port above 1023 with --port") from None
        raise CLIError(f"cannot bind {host}:{port} ({exc.strerror}); check --host") from None
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{sock.getsockname()[1]}"


EXIT_ENGINE_FAULT = 1

log = logging.getLogger("dialspec.gateway")


def make_server(app, config_kwargs: dict, banner: str | None = None, on_listening=None):
    """A GatewayServer for `app` that prints `banner` and calls `on_listening()` once it listens."""
    import uvicorn

    class GatewayServer(uvicorn.Server):
        """uvicorn with the gateway's drain on the first signal (see the module docstring)."""

        def __init__(self, config):
            super().__init__(config)
            # a create_app app; any other ASGI app (tests' fakes) just stops on shutdown
            self.gateway = getattr(getattr(app, "state", None), "gateway", None)
            self.exit_code = 0
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            if self.gateway is not None:
                self.gateway.on_fatal = self._on_fatal
            await super().startup(sockets=sockets)
            if self.started and on_listening is not None:
                on_listening()
            if self.started and banner:
                print(banner, flush=True)

        def handle_exit(self, sig, frame):
            if self._draining or self._loop is None:
                super().handle_exit(sig, frame)  # a second signal (or none to drain): exit now
            else:
                log.info("signal %d: draining, then exiting (send it again to exit at once)", sig)
                self.begin_shutdown()

        def begin_shutdown(self) -> None:
            """Drain, then exit (thread-safe; a no-op when a shutdown is already under way)."""
            if self._draining or self._loop is None:
                self.should_exit = True
                return
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

        def _on_fatal(self) -> None:
            self.exit_code = EXIT_ENGINE_FAULT
            self.begin_shutdown()

        async def _drain_then_exit(self) -> None:
            try:
                if self.gateway is not None:
                    await self.gateway.shutdown()
            finally:
                self.should_exit = True

    # The slow-client bounds come from the gateway's settings (slow_clients.py); tests' fakes
    # (no gateway) run with uvicorn's defaults.
    settings = _settings_of(app)
    limits = uvicorn_limits(settings) if settings is not None else {}
    return GatewayServer(uvicorn.Config(app, **{**limits, **config_kwargs}))


def _settings_of(app):
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    return getattr(gateway, "settings", None)


# -- while the engine loads --------------------------------------------------------------------
async def starting_app(scope, receive, send) -> None:
    """The whole API while the engine loads: /health 200 (the process is alive), everything else
    503 `starting` with Retry-After, as /ready answers until the engine can generate."""
    if scope["type"] != "http":  # (run with lifespan="off")
        return
    if scope["path"] == "/health":
        response = JSONResponse({"status": "ok"})
    else:
        response = APIError(
            503, "the server is starting (loading the engine); retry shortly", code="starting",
            headers={"Retry-After": "1"},
        ).response()  # fmt: skip
    await response(scope, receive, send)


class StartingServer:
    """`starting_app` on a bound socket, in a thread, from before the engine loads until the real
    server listens, so probes get an answer instead of a refused connection meanwhile.

    It listens on a duplicate of the socket: the same kernel socket, so when it closes its
    duplicate the original stays open, and connections that arrive in between wait in the backlog
    instead of being refused. The real server calls `join()` once it listens (before it prints
    its URL); a connection accepted here in that moment gets 503 `starting` and retries."""

    def __init__(self, sock: socket.socket, settings=None, log_level: str = "warning"):
        import uvicorn

        limits = uvicorn_limits(settings) if settings is not None else {}  # the same slow-client bounds
        self._server = uvicorn.Server(
            uvicorn.Config(starting_app, **limits, log_level=log_level, lifespan="off")
        )
        self._listener = sock.dup()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._listener]}, daemon=True
        )

    def start(self) -> StartingServer:
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.005)
        return self

    def join(self) -> None:
        """Stop it and wait until it has closed its listener (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._listener.close()
