"""`dialspec serve`: the OpenAI-compatible gateway on the embedded engine, offline.

    dialspec serve                         # the shipped embedded pair on 127.0.0.1:8000
    dialspec serve --target T --draft D    # any HF-format pair sharing a tokenizer
    dialspec serve --port 0                # a free port (the URL line says which)
    dialspec serve --backend sglang --sglang-url http://gpu-0:30000 --tokenizer T
                                           # front an SGLang runtime or router (GPU nodes)

Settings beyond the flags come from `DIALSPEC_*` environment variables or `--config FILE`
(see settings.py). The engine module (torch) is imported only here, when serving starts.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from server.cli import CLIError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API with the quality dial",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0 = any free port (default 8000)")
    p.add_argument("--target", type=Path, help="target model directory (default: the embedded pair)")
    p.add_argument("--draft", type=Path, help="draft model directory (default: the embedded pair)")
    p.add_argument("--served-name", help="model name in the API (default: the pair's name)")
    p.add_argument("--num-draft", type=int, default=5, help="default draft length N (default 5)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens (default 2048)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--config", type=Path, help="gateway settings file (.toml or .json)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="require this Bearer key (repeatable)")
    p.add_argument("--max-waiting", type=int, help="queued requests beyond which the server answers 429")
    p.add_argument(
        "--backend",
        choices=["embedded", "sglang"],
        default=os.environ.get("DIALSPEC_BACKEND", "embedded"),
        help="engine: the embedded CPU engine, or an SGLang runtime/router (env DIALSPEC_BACKEND)",
    )
    p.add_argument(
        "--sglang-url",
        default=os.environ.get("DIALSPEC_SGLANG_URL"),
        help="SGLang runtime or router base URL, without /v1 (env DIALSPEC_SGLANG_URL)",
    )
    p.add_argument(
        "--tokenizer",
        default=os.environ.get("DIALSPEC_TOKENIZER"),
        help="sglang backend: the pair's tokenizer (dir or HF id; env DIALSPEC_TOKENIZER)",
    )
    p.add_argument(
        "--head",
        default=os.environ.get("DIALSPEC_HEAD"),
        help="learned weight head dir for quality 'auto' (default: the embedded pair's head/; 'none' = off)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def tcp_socket(host: str) -> socket.socket:
    """A listening-socket candidate that uvicorn's connections will stream from without delay.

    The protocol must be named: asyncio sets TCP_NODELAY only on transports whose socket says
    IPPROTO_TCP, and with protocol 0 Nagle's algorithm holds small SSE writes back until the
    client's delayed ACK (~40 ms added to the first token on a reused connection).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def _bind(host: str, port: int) -> socket.socket:
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


def _check_model_dir(path: Path, flag: str) -> Path:
    if not path.is_dir():
        raise CLIError(
            f"model directory {path} does not exist; point {flag} at an HF-format checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise CLIError(f"{path} has no config.json; point {flag} at an HF-format checkpoint directory")
    return path


def _pair_paths(args) -> tuple[Path, Path, str | None, Path | None]:
    """(target, draft, served name, head dir) — the head defaults to the embedded pair's own."""
    if (args.target is None) != (args.draft is None):
        raise CLIError("pass both --target and --draft, or neither (to serve the embedded pair)")
    head = None if args.head in (None, "none") else Path(args.head)
    if head is not None and not head.is_dir():
        raise CLIError(f"no weight head at {head}; train one with `dialspec train` or drop --head")
    if args.target is not None:
        return _check_model_dir(args.target, "--target"), _check_model_dir(args.draft, "--draft"), None, head
    try:
        from training.embedded_pair import verify_pair
    except ImportError:
        raise CLIError(
            "the embedded pair is not available in this checkout (training/embedded_pair.py); "
            "pass --target and --draft"
        ) from None
    try:
        pair = verify_pair()
    except Exception as exc:  # missing or corrupt files: the pair module's message says what to do
        raise CLIError(f"embedded pair not usable: {exc} (or pass --target and --draft)") from None
    shipped_head = Path(pair.target).parent / "head"
    if args.head is None and shipped_head.is_dir():
        head = shipped_head
    return Path(pair.target), Path(pair.draft), pair.name, head


def _settings(args):
    from pydantic import ValidationError

    from server.gateway.settings import load_settings

    try:
        return load_settings(args.config, api_keys=args.api_keys, max_waiting=args.max_waiting)
    except FileNotFoundError as exc:
        raise CLIError(f"{exc}; fix --config or DIALSPEC_CONFIG") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CLIError(
            f"bad setting {where}: {first['msg']} (check DIALSPEC_* variables and --config)"
        ) from None


def _embedded_engine(args, target: Path, draft: Path, name: str | None, head: Path | None):
    from server.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig  # torch: only now

    return EmbeddedEngine(
        EmbeddedEngineConfig(
            target_path=target,
            draft_path=draft,
            num_draft=args.num_draft,
            max_batch=args.max_batch,
            max_context=args.max_context,
            device=args.device,
            served_name=args.served_name or name,
            head=head,  # loaded and checked against the pair when the engine is built
        )
    )


def _sglang_engine(args):
    from server.engine.sglang_client import SGLangEngine

    return SGLangEngine(
        args.sglang_url,
        args.tokenizer,
        model=args.served_name or "dialspec-pair",
        num_draft=args.num_draft,
        max_context=args.max_context,
        max_batch=args.max_batch,
    )


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--num-draft", args.num_draft), ("--max-batch", args.max_batch)):
        if value < 1:
            raise CLIError(f"{flag} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise CLIError("--port must lie in 0..65535")
    settings = _settings(args)
    if args.backend == "sglang" and not (args.sglang_url and args.tokenizer):
        raise CLIError(
            "--backend sglang needs --sglang-url and --tokenizer (or DIALSPEC_SGLANG_URL/_TOKENIZER)"
        )
    pair = _pair_paths(args) if args.backend == "embedded" else None
    sock = _bind(args.host, args.port)  # before loading models: a busy port fails in a second

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from server.gateway.app import create_app

    try:
        engine = _embedded_engine(args, *pair) if pair else _sglang_engine(args)
    except Exception as exc:
        sock.close()
        raise CLIError(f"cannot set up the {args.backend} engine: {type(exc).__name__}: {exc}") from None

    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{port}"

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:  # listening now: the URL works the moment it is printed
                print(
                    f"dialspec: serving '{engine.info.model}' at {url}/v1 "
                    f"(docs {url}/docs, metrics {url}/metrics)",
                    flush=True,
                )

    app = create_app(engine, settings)
    server = _Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
        )
    )
    server.run(sockets=[sock])
    if not server.started:
        raise CLIError("the server did not start (the engine failed to load; see the log above)")
    return 0


if __name__ == "__main__":
    from server.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
