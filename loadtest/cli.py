"""`dialspec loadtest`: benchmark a dialspec (or any OpenAI-compatible) server per quality tier.

    dialspec loadtest --url http://127.0.0.1:8000 --concurrency 1,4,8 --num-requests 200
    dialspec loadtest --url http://127.0.0.1:8000 --rate 2 --duration 120 \\
        --tiers lite:0.3,standard:0.4,pro:0.3 --prompts my_prompts.jsonl

Every phase stops at --num-requests requests or --duration seconds, whichever comes first.
Traffic goes only to --url (and its /metrics, or --metrics-url). Results: the report on the
terminal, `report.json`, `requests.jsonl` and plots under --out/<timestamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadtest.client import RequestOptions, RequestSpec
from loadtest.prompts import PromptError, load_prompts
from loadtest.runner import PhaseResult, run_phase
from loadtest.schedule import LoadShape, parse_sweep
from loadtest.scrape import delta, scrape
from loadtest.summary import summarize_phase
from loadtest.tiers import TierMixError, assign, format_tier_mix, parse_floor_mix, parse_tier_mix


class UsageError(Exception):
    """A user mistake: `dialspec` prints it as one line (this package needs nothing from the
    server but its HTTP API, so it brings its own error type; see CLI_ERRORS)."""


CLI_ERRORS = (UsageError,)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "loadtest",
        help="serving benchmark per quality tier (latency, throughput, acceptance), with plots",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)"
    )
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument(
        "--endpoint", choices=["chat", "completions"], default="chat", help="API to load (default chat)"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", help="closed loop: requests in flight; a list sweeps, e.g. 1,4,8 (default 4)"
    )
    load.add_argument(
        "--rate", help="open loop: Poisson arrivals in req/s (or inf); a list sweeps, e.g. 1,2,4"
    )
    p.add_argument("--max-concurrency", type=int, help="with --rate: cap on requests in flight")
    p.add_argument("--num-requests", type=int, default=100, help="request bound per phase (default 100)")
    p.add_argument("--duration", type=float, default=60.0, help="time bound per phase, seconds (default 60)")
    p.add_argument(
        "--prompts", default="suite", help="'suite', 'suite:math,code', or a JSONL file (default suite)"
    )
    p.add_argument(
        "--tiers", help="tier mix sent as `quality`, e.g. lite:0.3,standard:0.4,pro:0.3 (default: none)"
    )
    p.add_argument(
        "--floors",
        help="dialspec brownout: mix of `min_quality` floors, e.g. 0:0.5,lite:0.3,none:0.2 "
        "(`none` sends no floor; default: no floors)",
    )
    p.add_argument(
        "--slo-ttft-ms", type=float, help="TTFT objective: goodput counts the requests that met it"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true (fixed-length outputs, vLLM style)"
    )
    p.add_argument(
        "--extra-body", help='JSON object merged into every request, e.g. \'{"verifier": "lossy"}\''
    )
    p.add_argument(
        "--api-key", default=os.environ.get("DIALSPEC_API_KEY"), help="Bearer key (default $DIALSPEC_API_KEY)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="per-request limit, seconds (default 120)"
    )
    p.add_argument("--metrics-url", help="Prometheus endpoint to cross-check (default URL/metrics)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds prompts, tiers, arrivals and per-request seeds (default 0)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/loadtest"), help="results folder (default runs/loadtest)"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG/SVG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def make_transport() -> httpx.AsyncHTTPTransport:
    """Unbounded connection pool, keep-alive, and TCP_NODELAY on every socket: the generator's own
    small writes (headers, then body) must never wait for a delayed ACK (Nagle), which would add up
    to ~40 ms to the measured TTFT."""
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    )


def base_url(url: str) -> str:
    """Validate --url; accepts `http://host:port` or `.../v1` and returns the part before /v1."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--url {url!r} is not an http(s) URL; write e.g. --url http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise UsageError(f"--url {url!r} has a bad port; write e.g. --url http://127.0.0.1:8000") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _shapes(args) -> list[LoadShape]:
    try:
        if args.rate is not None:
            if args.max_concurrency is not None and args.max_concurrency < 1:
                raise UsageError("--max-concurrency must be at least 1")
            return [LoadShape("rate", v, args.max_concurrency) for v in parse_sweep(args.rate, "rate")]
        if args.max_concurrency is not None:
            raise UsageError(
                "--max-concurrency applies to --rate runs; with --concurrency it is the concurrency"
            )
        return [LoadShape("concurrency", v) for v in parse_sweep(args.concurrency or "4", "concurrency")]
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_args(args) -> None:
    if args.num_requests < 1:
        raise UsageError("--num-requests must be at least 1")
    if not args.duration > 0:
        raise UsageError("--duration must be a positive number of seconds")
    if not args.request_timeout > 0:
        raise UsageError("--request-timeout must be a positive number of seconds")
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if args.slo_ttft_ms is not None and not args.slo_ttft_ms > 0:
        raise UsageError("--slo-ttft-ms must be a positive number of milliseconds")


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f'--extra-body is not valid JSON ({exc.msg}); write e.g. \'{{"verifier": "lossy"}}\''
        ) from None
    if not isinstance(obj, dict):
        raise UsageError("--extra-body must be a JSON object")
    return obj


async def preflight(client: httpx.AsyncClient, url: str, model: str | None) -> str:
    """Reach the server once (GET /v1/models) before loading it; returns the model to request."""
    try:
        resp = await client.get("/v1/models", timeout=10.0)
    except httpx.ConnectError:
        raise UsageError(
            f"cannot connect to {url} (nothing listening?); "
            "start the server (e.g. `dialspec serve`) or fix --url"
        ) from None
    except httpx.TimeoutException:
        raise UsageError(
            f"{url} did not answer within 10 s; check the server is healthy or fix --url"
        ) from None
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach {url} ({type(exc).__name__}: {exc}); fix --url") from None
    if resp.status_code == 401:
        raise UsageError(f"{url} rejected the API key (401); pass the server's key with --api-key")
    if resp.status_code == 200:
        try:
            ids = [m["id"] for m in resp.json().get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            ids = []
        if model is None:
            if not ids:
                raise UsageError(f"{url}/v1/models lists no model; pass --model")
            return ids[0]
        return model
    if model is None:
        raise UsageError(
            f"{url}/v1/models answered HTTP {resp.status_code}; pass --model (is --url the API root?)"
        )
    return model


def plan_requests(n: int, prompts, tiers, floors, seed: int) -> list[RequestSpec]:
    """The workload: prompt, tier, floor and seed of each request, fixed by `seed` alone."""
    chosen = assign(tiers, n, seed)
    floor_of = assign(floors, n, seed, stream="floors") if floors else [None] * n
    return [
        RequestSpec(i, prompts[i % len(prompts)], chosen[i], seed * 1_000_003 + i, floor_of[i])
        for i in range(n)
    ]


@dataclass
class _State:
    """What the run has so far, kept outside the event loop so Ctrl-C still writes a report."""

    model: str | None = None
    phases: list[dict] = field(default_factory=list)
    shape: LoadShape | None = None  # the phase under way
    records: list = field(default_factory=list)  # its finished requests
    start: float = 0.0


def _interrupted_phase(
    state: _State, planned: int, tier_order: list[str], slo_ttft_ms: float | None
) -> dict | None:
    """The phase under way at Ctrl-C, from the requests that had finished (in-flight ones are lost)."""
    if state.shape is None or not state.records:
        return None
    records = sorted(state.records, key=lambda r: r.index)
    result = PhaseResult(state.shape, records, time.perf_counter() - state.start, planned, "interrupted")
    phase = summarize_phase(result, None, "run interrupted (Ctrl-C)", tier_order, slo_ttft_ms)
    phase["records"] = [r.to_json() for r in records]
    return phase


async def _run_phases(args, url, opts, plan, shapes, tiers, console, state: _State) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from loadtest.render import print_phase

    metrics_url = args.metrics_url or f"{url}/metrics"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout, connect=min(10.0, args.request_timeout))
    async with httpx.AsyncClient(
        base_url=url, headers=headers, transport=make_transport(), timeout=timeout, trust_env=False
    ) as client:
        opts = RequestOptions(**{**opts.__dict__, "model": await preflight(client, url, opts.model)})
        state.model = opts.model
        console.print(
            f"loadtest: {url} model={opts.model} endpoint={opts.endpoint} requests<={len(plan)} "
            f"duration<={args.duration:g}s tiers={format_tier_mix(tiers)}",
            highlight=False,
        )
        for shape in shapes:
            before, err = (None, "--no-metrics") if args.no_metrics else await scrape(client, metrics_url)
            failed = 0
            state.shape, state.records, state.start = shape, [], time.perf_counter()
            with Progress(
                TextColumn(f"[bold]{shape.label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                disable=args.quiet,
            ) as progress:
                task = progress.add_task("run", total=len(plan), failed=0)

                def on_done(rec, task=task, progress=progress):
                    nonlocal failed
                    failed += 0 if rec.ok else 1
                    state.records.append(rec)
                    progress.update(task, advance=1, failed=failed)

                result = await run_phase(client, plan, opts, shape, args.duration, args.seed, on_done)
            after = None
            if before is not None:
                after, err = await scrape(client, metrics_url)
            d = delta(before, after) if (before is not None and after is not None) else None
            phase = summarize_phase(result, d, err, [t.name for t in tiers], args.slo_ttft_ms)
            phase["records"] = [r.to_json() for r in result.records]
            print_phase(console, phase)
            state.phases.append(phase)
            state.shape = None


def _write(args, out_dir: Path, config: dict, phases: list[dict]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "requests.jsonl").open("w") as fh:
        for p in phases:
            for r in p["records"]:
                fh.write(json.dumps({"phase": p["label"], **r}) + "\n")
    report = {"config": config, "phases": [{k: v for k, v in p.items() if k != "records"} for p in phases]}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    written = [out_dir / "report.json", out_dir / "requests.jsonl"]
    if not args.no_plots:
        from loadtest.plots import plot_all

        written += plot_all(report["phases"], out_dir)
    return written


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    _check_args(args)
    url = base_url(args.url)
    shapes = _shapes(args)
    try:
        tiers = parse_tier_mix(args.tiers)
    except TierMixError as exc:
        raise UsageError(f"--tiers: {exc}") from None
    try:
        floors = parse_floor_mix(args.floors)
    except TierMixError as exc:
        raise UsageError(f"--floors: {exc}") from None
    n_tasks = 3 if args.prompts == "suite" else max(1, len(args.prompts.partition(":")[2].split(",")))
    try:
        prompts = load_prompts(args.prompts, min(100, math.ceil(args.num_requests / n_tasks)), args.seed)
    except PromptError as exc:
        raise UsageError(str(exc)) from None
    if args.endpoint == "completions" and any(len(p.messages) > 1 for p in prompts):
        raise UsageError("multi-message prompts need --endpoint chat")
    opts = RequestOptions(
        model=args.model,
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=_extra_body(args.extra_body),
        timeout=args.request_timeout,
    )
    plan = plan_requests(args.num_requests, prompts, tiers, floors, args.seed)
    console = Console(width=None if sys.stdout.isatty() else 132)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    state = _State(model=args.model)
    interrupted = False
    try:
        asyncio.run(_run_phases(args, url, opts, plan, shapes, tiers, console, state))
    except KeyboardInterrupt:
        interrupted = True
        partial = _interrupted_phase(state, len(plan), [t.name for t in tiers], args.slo_ttft_ms)
        if partial is not None:
            from loadtest.render import print_phase

            print_phase(console, partial)
            state.phases.append(partial)
    phases = state.phases
    if not phases:
        return 130
    config = {
        "url": url,
        "model": state.model,
        "endpoint": args.endpoint,
        "shapes": [s.label for s in shapes],
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "prompts": args.prompts,
        "tiers": format_tier_mix(tiers),
        "floors": format_tier_mix(floors) if floors else None,
        "slo_ttft_ms": args.slo_ttft_ms,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "extra_body": opts.extra_body,
        "request_timeout_s": args.request_timeout,
        "seed": args.seed,
        "started_utc": started.isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
    }
    out_dir = args.out / started.strftime("%Y%m%d-%H%M%S")
    written = _write(args, out_dir, config, phases)
    if len(phases) > 1:
        from loadtest.render import sweep_table

        console.print(sweep_table(phases))
    console.print(f"loadtest: wrote {', '.join(p.name for p in written)} to {out_dir}", highlight=False)
    if interrupted:
        return 130
    if all(p["completed"] == 0 for p in phases):
        console.print("loadtest: every request failed; see the failure kinds above", highlight=False)
        return 1
    return 0
