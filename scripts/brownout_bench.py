"""Brownout off vs on, open loop, on the embedded engine: does the dial absorb overload?

    python scripts/brownout_bench.py [--multipliers 0.5,1,1.5,2,3] [--floors 0:1] [--slo-ttft-ms 2000]
                                     [--duration 30] [--max-tokens 128] [--out docs/bench]

Starts two `dialspec serve` gateways on the embedded pair (loopback, free ports): one as shipped
(brownout off) and one with `DIALSPEC_BROWNOUT_TTFT_S` = the objective. Measures exact's capacity
(closed loop at the batch size, no floors), then for each multiple of it sends the same seeded
Poisson workload (`dialspec loadtest`'s own client and statistics, floors drawn from `--floors`)
to both, off and on alternated per rate so that host drift hits both, and reports per rate:
goodput (requests whose TTFT met the objective, per second), p50/p99 TTFT and e2e, the 429 rate,
mean served quality and requests served below their floor. Writes `brownout.json`, `brownout.md`
(with the target lines) and `brownout.png` under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.cli import make_transport, plan_requests  # noqa: E402
from loadtest.client import RequestOptions  # noqa: E402
from loadtest.prompts import load_prompts  # noqa: E402
from loadtest.runner import run_phase  # noqa: E402
from loadtest.schedule import LoadShape  # noqa: E402
from loadtest.summary import summarize_phase  # noqa: E402
from loadtest.tiers import parse_floor_mix, parse_tier_mix  # noqa: E402

DIALSPEC = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"]


class Gateway:
    """One `dialspec serve` process on a free loopback port."""

    def __init__(self, name: str, env: dict[str, str], max_batch: int):
        self.name = name
        cmd = [*DIALSPEC, "serve", "--port", "0", "--max-batch", str(max_batch), "--log-level", "warning"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env}
        )
        deadline = time.monotonic() + 300
        self.url = None
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise SystemExit(f"brownout_bench: the {name} server exited ({self.proc.returncode})")
            if m := re.search(r"(http://\S+)/v1", line):
                self.url = m.group(1)
        while httpx.get(self.url + "/ready", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"brownout_bench: the {name} server never became ready")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _phase(url, plan, opts, shape, duration, seed, slo_ms):
    async with httpx.AsyncClient(base_url=url, transport=make_transport(), timeout=opts.timeout) as client:
        result = await run_phase(client, plan, opts, shape, duration, seed)
    return summarize_phase(result, slo_ttft_ms=slo_ms)


def _row(phase: dict) -> dict:
    svc = phase["service"]
    return {
        "sent": phase["sent"],
        "completed": phase["completed"],
        "goodput": svc["goodput"],
        "throughput": phase["request_throughput"],
        "ttft_p50_ms": phase["ttft_ms"]["median"],
        "ttft_p99_ms": phase["ttft_ms"]["p99"],
        "e2e_p50_ms": phase["e2e_ms"]["median"],
        "e2e_p99_ms": phase["e2e_ms"]["p99"],
        "refused_rate": svc["refused_rate"],
        "served_quality": svc["served_quality_mean"],
        "lowered": svc["lowered"],
        "below_floor": svc["below_floor"],
        "client_lag_p99_ms": phase["client_lag_ms"]["p99"],
    }


def run(args) -> dict:
    tiers, floors = parse_tier_mix("exact"), parse_floor_mix(args.floors)
    prompts = load_prompts("suite", 100, args.seed)
    opts = RequestOptions(model="dialspec-embedded", max_tokens=args.max_tokens, timeout=args.timeout)
    objective = {"DIALSPEC_BROWNOUT_TTFT_S": str(args.slo_ttft_ms / 1000)}
    servers = {
        "off": Gateway("off", {}, args.max_batch),
        "on": Gateway("on", objective, args.max_batch),
    }
    try:
        n = max(64, args.max_batch * 16)
        warm = plan_requests(n, prompts, tiers, None, args.seed)
        cap_phases = {}
        for name, gw in servers.items():  # warm both, measure exact's capacity on each
            cap_phases[name] = asyncio.run(
                _phase(gw.url, warm, opts, LoadShape("concurrency", args.max_batch), 120, args.seed, None)
            )
        capacity = min(p["request_throughput"] for p in cap_phases.values())
        print(f"capacity at exact: {capacity:.2f} req/s (closed loop, c = {args.max_batch})", flush=True)
        rows = []
        for i, m in enumerate(args.multipliers):
            rate = m * capacity
            plan = plan_requests(int(rate * args.duration * 1.5) + 10, prompts, tiers, floors, args.seed + i)
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            row = {"multiplier": m, "rate": rate}
            for name in order:
                phase = asyncio.run(
                    _phase(servers[name].url, plan, opts, LoadShape("rate", rate), args.duration,
                           args.seed + i, args.slo_ttft_ms)
                )  # fmt: skip
                row[name] = _row(phase)
                print(f"x{m:g} ({rate:.2f} req/s) brownout {name}: {json.dumps(row[name])}", flush=True)
                time.sleep(args.settle)  # the on server's controller recovers between phases
            rows.append(row)
    finally:
        for gw in servers.values():
            gw.stop()
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"capacity_rps": capacity},
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }


def targets(result: dict) -> list[tuple[str, bool, str]]:
    """The issue's target lines, each (claim, met, measured)."""
    rows, slo = result["rows"], result["config"]["slo_ttft_ms"]
    out = []
    at2 = next((r for r in rows if r["multiplier"] == 2), None)
    floors = parse_floor_mix(result["config"]["floors"]) or []
    if at2 and floors and all(f.quality == 0 for f in floors):  # the target is stated for floors at 0
        ratio = at2["on"]["goodput"] / at2["off"]["goodput"] if at2["off"]["goodput"] else float("inf")
        out.append(("at 2x capacity: goodput on >= 1.5x off", ratio >= 1.5, f"{ratio:.2f}x"))
        p99 = at2["on"]["ttft_p99_ms"]
        out.append(
            (f"at 2x capacity: p99 TTFT on <= {slo:g} ms", p99 is not None and p99 <= slo, f"{p99:.0f} ms")
        )
    below = sum(r[m]["below_floor"] for r in rows for m in ("off", "on"))
    out.append(("no request served below its floor", below == 0, str(below)))
    under = [r for r in rows if r["multiplier"] < 1]
    lowered = sum(r["on"]["lowered"] for r in under)
    out.append(("below capacity nothing is lowered", lowered == 0, f"{lowered} lowered"))
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    head = (
        f"# Brownout off vs on (embedded pair, {result['started_utc']})\n\n"
        f"`python scripts/brownout_bench.py --multipliers {','.join(f'{m:g}' for m in c['multipliers'])} "
        f"--floors {c['floors']} --slo-ttft-ms {c['slo_ttft_ms']:g} --duration {c['duration']:g} "
        f"--max-tokens {c['max_tokens']} --settle {c['settle']:g}`: exact requests, floors "
        f"`{c['floors']}`, TTFT objective "
        f"{c['slo_ttft_ms']:g} ms, capacity at exact {c['capacity_rps']:.2f} req/s (closed loop at "
        f"c = {c['max_batch']}).\n\n"
        "| load (x cap) | req/s | goodput off | goodput on | TTFT p99 off | TTFT p99 on | e2e p99 off "
        "| e2e p99 on | 429 off | 429 on | quality on | lowered on | below floor "
        "| generator lag p99 off / on |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def f(x, d=2):
        return "n/a" if x is None else f"{x:.{d}f}"

    lines = []
    for r in result["rows"]:
        off, on = r["off"], r["on"]
        lines.append(
            f"| {r['multiplier']:g} | {r['rate']:.2f} | {f(off['goodput'])} | {f(on['goodput'])} | "
            f"{f(off['ttft_p99_ms'], 0)} | {f(on['ttft_p99_ms'], 0)} | {f(off['e2e_p99_ms'], 0)} | "
            f"{f(on['e2e_p99_ms'], 0)} | {f(100 * off['refused_rate'], 1)} % | "
            f"{f(100 * on['refused_rate'], 1)} % | {f(on['served_quality'])} | {on['lowered']} | "
            f"{off['below_floor'] + on['below_floor']} | {f(off.get('client_lag_p99_ms'), 0)} / "
            f"{f(on.get('client_lag_p99_ms'), 0)} ms |"
        )
    checks = "\n".join(
        f"- {'met' if ok else 'MISSED'}: {claim} ({got})" for claim, ok, got in targets(result)
    )
    note = (
        "\n\nThe load generator runs on the same host: where its own event loop lagged over "
        "100 ms (last column), its latencies include that lag and measure the generator, not the gateway."
    )
    return head + "\n".join(lines) + note + "\n\nTargets (this run):\n\n" + checks + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["multiplier"] for r in rows]
    panels = [
        ("goodput", "goodput (req/s meeting the TTFT objective)", 1.0),
        ("ttft_p99_ms", "p99 TTFT (ms)", 1.0),
        ("refused_rate", "429 share (%)", 100.0),
        ("served_quality", "mean quality served", 1.0),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=True):
        for mode, style in (("off", "o--"), ("on", "s-")):
            ys = [None if r[mode][key] is None else scale * r[mode][key] for r in rows]
            ax.plot(xs, ys, style, label=f"brownout {mode}")
        if key == "ttft_p99_ms":
            ax.axhline(result["config"]["slo_ttft_ms"], color="grey", lw=0.8, ls=":", label="objective")
        ax.set_xlabel("arrival rate (x exact's capacity)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Brownout on the embedded pair: floors {result['config']['floors']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--multipliers", default="0.5,1,1.5,2,3", help="arrival rates as multiples of capacity")
    p.add_argument("--floors", default="0:1", help="min_quality mix (loadtest --floors syntax)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the TTFT objective (default 2000)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per phase")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request limit, seconds")
    p.add_argument("--settle", type=float, default=10.0, help="seconds between phases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--name", default="brownout", help="file stem under --out")
    args = p.parse_args(argv)
    args.multipliers = [float(x) for x in args.multipliers.split(",")]
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(result))
    plot(result, args.out / f"{args.name}.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
