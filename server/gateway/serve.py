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
import logging
import os
from pathlib import Path

from server.cli_errors import CLIError
from server.gateway.engines import choose_pair, embedded_engine, sglang_engine
from server.gateway.listen import StartingServer, bind, make_server, url_of


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
    p.add_argument(
        "--num-draft",
        default="auto",
        help="draft length N: 'auto' (default) picks it per request and round from measured costs "
        "(0 = no drafts when they do not pay); a number fixes the default (requests may still set theirs)",
    )
    p.add_argument(
        "--strict-nu",
        action="store_true",
        help="with --num-draft auto: draw every token of a w < 1 request from ν, also in rounds where "
        "drafting does not pay (one draft step per token, slower than plain decoding there); by default "
        "such rounds draw from the target's p and report them as target_only_rounds",
    )
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens (default 2048)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="model dtype, cast once at load; auto: bfloat16 on CUDA, on CPU whichever this machine "
        "runs the pair faster in (measured at start, cached)",
    )
    p.add_argument("--config", type=Path, help="gateway settings file (.toml or .json)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="require this Bearer key (repeatable)")
    p.add_argument("--max-waiting", type=int, help="queued requests beyond which the server answers 429")
    p.add_argument(
        "--brownout-ttft",
        type=float,
        metavar="SECONDS",
        help="brownout: under overload, serve requests that set a min_quality lower (never below it) to "
        "hold this time to first token; 0 = off (default; DIALSPEC_BROWNOUT_TTFT_S)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        help="seconds in-flight requests get to finish after SIGTERM (default 30; DIALSPEC_DRAIN_TIMEOUT_S)",
    )
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
        "--sglang-has-head",
        action="store_true",
        # The runtime's own variable (server/sglang_plugin/params.py): one setting for both processes.
        default=bool(os.environ.get("DIALSPEC_HEAD_PATH")),
        help="sglang backend: the runtime was launched with a learned head, so quality 'auto' is "
        "served (default: on when DIALSPEC_HEAD_PATH is set, as for the runtime)",
    )
    p.add_argument(
        "--sglang-probe-interval",
        type=float,
        default=os.environ.get("DIALSPEC_SGLANG_PROBE_INTERVAL", "60"),  # argparse applies `type`
        help="sglang backend: seconds between plugin probes behind /ready (default 60)",
    )
    p.add_argument(
        "--head",
        default=os.environ.get("DIALSPEC_HEAD"),
        help="learned weight head dir for quality 'auto' (default: the embedded pair's head/; 'none' = off)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _settings(args):
    from pydantic import ValidationError

    from server.gateway.settings import load_settings

    try:
        return load_settings(
            args.config,
            api_keys=args.api_keys,
            max_waiting=args.max_waiting,
            drain_timeout_s=args.drain_timeout,
            brownout_ttft_s=args.brownout_ttft,
        )
    except FileNotFoundError as exc:
        raise CLIError(f"{exc}; fix --config or DIALSPEC_CONFIG") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CLIError(
            f"bad setting {where}: {first['msg']} (check DIALSPEC_* variables and --config)"
        ) from None


def parse_num_draft(text: str) -> int | None:
    """`--num-draft`: 'auto' -> None (adaptive), else an integer >= 1."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise CLIError(f"--num-draft must be 'auto' or an integer >= 1, got {text!r}")
    return n


def run(args: argparse.Namespace) -> int:
    args.num_draft = parse_num_draft(str(args.num_draft))
    if args.max_batch < 1:
        raise CLIError("--max-batch must be at least 1")
    if not args.sglang_probe_interval > 0:
        raise CLIError("--sglang-probe-interval must be a positive number of seconds")
    if not 0 <= args.port <= 65535:
        raise CLIError("--port must lie in 0..65535")
    settings = _settings(args)
    if args.backend == "sglang" and not (args.sglang_url and args.tokenizer):
        raise CLIError(
            "--backend sglang needs --sglang-url and --tokenizer (or DIALSPEC_SGLANG_URL/_TOKENIZER)"
        )
    sock = bind(args.host, args.port)  # before loading models: a busy port fails in a second

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from server.gateway.app import create_app

    # Probes get 503 `starting` (not a refused connection) until the real server listens, which
    # is after the engine has loaded (the app's lifespan).
    starting = StartingServer(sock, settings).start()  # logs warnings only: one 'running on' line
    try:
        pair = choose_pair(args.target, args.draft, args.head) if args.backend == "embedded" else None
        try:
            engine = embedded_engine(args, pair) if pair else sglang_engine(args)
        except Exception as exc:
            raise CLIError(f"cannot set up the {args.backend} engine: {type(exc).__name__}: {exc}") from None
        url = url_of(args.host, sock)
        banner = (
            f"dialspec: serving '{engine.info.model}' at {url}/v1 (playground {url}/playground, "
            f"docs {url}/docs, metrics {url}/metrics)"
        )
        # The gateway drains before uvicorn stops (listen.GatewayServer): by then every response has
        # been ended, so uvicorn's own wait only lets the last bytes out.
        server = make_server(
            create_app(engine, settings),
            {"log_level": args.log_level, "timeout_graceful_shutdown": 15},
            banner,
            on_listening=starting.join,  # before the banner: from then on only the app answers
        )
        server.run(sockets=[sock])
    finally:
        starting.join()
        sock.close()
    if not server.started:
        raise CLIError("the server did not start (the engine failed to load; see the log above)")
    return server.exit_code
