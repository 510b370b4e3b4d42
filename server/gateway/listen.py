"""How the gateway listens: the TCP socket (bound before models load) and the uvicorn server.

Binding first means a busy port fails in a second, not after the engine has loaded; the socket is
handed to uvicorn, whose startup prints the URL the moment it is listening.

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

from server.cli_errors import CLIError


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


def make_server(app, config_kwargs: dict, banner: str | None = None):
    """A GatewayServer for `app` that prints `banner` once it is listening."""
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

    return GatewayServer(uvicorn.Config(app, **config_kwargs))
