"""`dialspec serve` as a process (tiny pair): SIGTERM drains and exits 0 with every stream ended
properly; an unrecoverable engine fault exits 1; the event loop stays responsive under a burst
of 200 requests and huge prompts (429s and /health add little to a same-run floor)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx

from tests.fake_sglang import free_port

NAME = "tiny-pair"
MAIN = "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"
# The engine breaks for good: every forward raises, so the probe request fails too.
BROKEN_ENGINE = (
    "import server.engine.embedded.scheduler as s\n"
    "def broken(*args, **kwargs):\n"
    "    raise RuntimeError('device lost')\n"
    "s.prefill = s.run_round = broken\n"
)


@contextmanager
def serve(tiny_pair, *flags: str, preamble: str = ""):
    """A `dialspec serve` process on the tiny pair; yields (process, base URL)."""
    target, draft = tiny_pair
    cmd = [sys.executable, "-c", preamble + MAIN, "serve", "--target", str(target), "--draft", str(draft)]
    cmd += ["--port", str(free_port()), "--served-name", NAME, "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"(http://\S+)/v1", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield proc, match.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_sigterm_drains_then_ends_streams_and_exits_0(tiny_pair):
    with serve(tiny_pair, "--max-context", "16384", "--drain-timeout", "3") as (proc, url):

        def stream(body: dict, events: list[str], started: threading.Event):
            body = {**body, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        # Greedy on the tiny pair: no EOS for thousands of tokens, far longer than the drain (a fast
        # host ran 4000 tokens within it: 16000 is ~16 s at 1000 tok/s).
        long_body = {"model": NAME, "prompt": "Tom has 12 apples", "max_tokens": 16000, "temperature": 0}
        short_body = {"model": NAME, "prompt": "Tom has", "max_tokens": 40, "temperature": 0}
        events, short, first, second = [], [], threading.Event(), threading.Event()
        t = threading.Thread(target=stream, args=(long_body, events, first))
        t.start()
        assert first.wait(60)
        shorter = threading.Thread(target=stream, args=(short_body, short, second))
        shorter.start()
        assert second.wait(60)  # both streams have produced tokens: both are in the engine
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json=short_body, timeout=10)  # answered, not refused
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(url + "/ready").status_code == 503
        t.join(60)
        shorter.join(60)
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stderr.read()
    assert short[-1] == "[DONE]"  # the short stream finished within the grace period
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    final = json.loads(events[-3])
    assert final["choices"][0]["finish_reason"] == "abort" and "dialspec" in final
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-3])


def test_unrecoverable_engine_fault_exits_1(tiny_pair):
    with serve(tiny_pair, preamble=BROKEN_ENGINE) as (proc, url):
        body = {"model": NAME, "prompt": "Tom has", "max_tokens": 5}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code in (500, 503) and "error" in r.json()
        assert proc.wait(60) == 1
        err = proc.stderr.read()
        assert "engine fault" in err and "supervisor" in err


async def burst(url: str, requests: int = 200, huge: int = 8, model: str = NAME) -> dict[str, list]:
    """`requests` completions at once plus `huge` ~0.9 MB prompts, while /health is polled.
    Returns latencies (s) by outcome: '429', '200', '404', 'huge' (the big prompts' answers),
    'health'; and 'huge_codes', the big prompts' error codes."""
    out: dict[str, list] = {"429": [], "200": [], "404": [], "huge": [], "health": [], "other": []}
    out["huge_codes"] = []
    limits = httpx.Limits(max_connections=requests + huge + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        normal = {"model": model, "prompt": "The quick brown fox " * 20, "max_tokens": 16}
        big = {"model": model, "prompt": "Tom has 12 apples. " * 47_000, "max_tokens": 16}  # ~0.9 MB

        async def one(body, kind):
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=body)
            dt = time.monotonic() - t0
            if kind == "huge" and r.status_code == 400:
                out["huge_codes"].append(r.json()["error"]["code"])
            key = kind if kind == "huge" and r.status_code != 404 else str(r.status_code)
            out[key if key in out else "other"].append(dt)

        async def poll_health(stop: asyncio.Event):
            while not stop.is_set():
                t0 = time.monotonic()
                await client.get("/health")
                out["health"].append(time.monotonic() - t0)
                await asyncio.sleep(0.02)

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(stop))
        await asyncio.sleep(0.1)
        jobs = [one(big, "huge") for _ in range(huge)] + [one(normal, "n") for _ in range(requests)]
        await asyncio.gather(*jobs)
        stop.set()
        await poller
    return out


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_burst_keeps_429s_fast_and_the_loop_responsive(tiny_pair):
    """200 requests and eight ~0.9 MB prompts at once at a server with 4 slots and 8 queue places.

    What it guards: before issue 12 the 429s waited behind every queued tokenization on the event
    loop (2-4 s at 200 requests) and 8 large prompts stalled /health for 7 s. Now a 429 needs only
    parsing and the admission check, and the large prompts are refused by their byte length
    without being tokenized (prepare.py): their answer is `context_length_exceeded` with "at least".

    Timing is compared with a floor measured by the same server in the same run: the same burst
    sent to an unknown model, which the gateway refuses (404) after parsing, before admission and
    tokenizing. On 2 cores the floor alone takes 0.3-0.8 s (208 connections, client and server on
    the same cores), so an absolute bound measures the host; the burst's time *above* the floor
    measures the gateway: 0.1-0.2 s here, 2+ s with tokenizing on the loop. Each kind runs three
    times alternately and keeps its best, so a noise burst must hit all three to fail the test."""
    trials: dict[str, list[dict]] = {"floor": [], "burst": []}
    with serve(tiny_pair, "--max-batch", "4", "--max-waiting", "8", "--max-context", "2048") as (proc, url):
        for _ in range(3):
            trials["floor"].append(asyncio.run(burst(url, model="no-such-model")))
            trials["burst"].append(asyncio.run(burst(url)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    for out in trials["floor"]:
        assert len(out["404"]) == 208 and not out["other"], {k: len(v) for k, v in out.items()}
    for out in trials["burst"]:
        assert not out["other"], out["other"]
        assert len(out["huge"]) == 8 and len(out["429"]) >= 150 and len(out["200"]) >= 12
        assert out["huge_codes"] == ["context_length_exceeded"] * 8  # refused by the byte bound

    def best(kind: str, key: str, stat) -> float:
        return min(stat(out[key]) for out in trials[kind])

    extra_429 = best("burst", "429", p99) - best("floor", "404", p99)
    extra_health = best("burst", "health", max) - best("floor", "health", max)
    assert extra_429 < 1.0, [sorted(out["429"])[-3:] for out in trials["burst"]]
    assert extra_health < 1.0, [sorted(out["health"])[-3:] for out in trials["burst"]]
