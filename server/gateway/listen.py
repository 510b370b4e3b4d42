"""How the gateway listens: the TCP socket (bound before models load) and the uvicorn server.

Binding first means a busy port fails in a second, not after the engine has loaded; the socket is
handed to uvicorn, whose startup prints the URL the moment it is listening.
"""

from __future__ import annotations

import errno
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


def make_server(app, config_kwargs: dict, banner: str):
    """A uvicorn server that prints `banner` once it is listening (so the URL works when shown)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, flush=True)

    return _Server(uvicorn.Config(app, **config_kwargs))
