"""The benchmark's workload: the pair's task-suite prompts, and the closed-loop engine driver."""

from __future__ import annotations

import threading
import time

NUM_PROMPTS = 8  # the default workload: these prompts x `waves`, identical at every concurrency
_GOLDEN = (5**0.5 - 1) / 2


def request_lengths(count: int, max_tokens: int, spread: float) -> list[int]:
    """Tokens for requests 0..count-1: max_tokens x (1 − spread + 2·spread·u_i), u_i = frac(i·φ⁻¹)
    (evenly spread, the same every run; the mean stays max_tokens).

    Why not one length for all: rows that start together and decode plainly then finish together,
    so every batch of plain decoding runs full and its replacements are prefilled together, while
    rows that draft finish at different rounds and each leaves its slot idle for the round before
    its replacement arrives. On the embedded pair at c = 8 that alone read the exact tier at 0.79x
    plain decoding, and 1.00x with lengths 16-32 (the same requests otherwise). Served traffic
    ends where its answers end, not in lockstep (vLLM's random workload spreads lengths alike)."""
    lengths = [max_tokens * (1 - spread + 2 * spread * ((i * _GOLDEN) % 1.0)) for i in range(count)]
    return [max(1, round(x)) for x in lengths]


def bench_prompts(n: int = NUM_PROMPTS) -> list[str]:
    """Test-split prompts of the embedded task suite, tasks interleaved (math, summary, code, ...).

    In-distribution for the embedded pair, so acceptance reflects the pair rather than prompts it
    was never trained on; any pair accepts them as plain chat messages.
    """
    from server.engine.model_pair import suite_prompts

    return suite_prompts(n)


# `--response-format json`: bounded (a random-weight pair would otherwise write one string until
# max_tokens) and with each kind of node, so masks are computed in every grammar state.
BENCH_SCHEMA = (
    '{"type":"object","properties":{"name":{"type":"string","maxLength":12},'
    '"count":{"type":"integer","minimum":0,"maximum":999},"ok":{"type":"boolean"},'
    '"tags":{"type":"array","items":{"enum":["a","b","c"]},"maxItems":4}},'
    '"required":["name","count","ok","tags"],"additionalProperties":false}'
)


def engine_run(
    engine, prompt_ids, max_tokens, temperature, verify, clients, waves=1, on_request=None, spread=0.0,
    response_format=None, seeded=True,
):  # fmt: skip
    """Closed loop: `clients` clients work through the same `len(prompt_ids) * waves` requests
    (request i: prompt i mod P, seed i if `seeded`, `request_lengths(.., max_tokens, spread)[i]`
    tokens, verification `verify`, output constraint `response_format`), each sending its next
    request when one finishes. Seeded requests give every method the same draws; unseeded ones
    are what the planner plans jointly (seeded rows are planned alone: `planner/draft_planner.py`).
    Returns (tokens, seconds, per-request SpecStats, the scheduler's timers)."""
    from server.engine.protocol import GenerationRequest, SamplingOptions

    done = threading.Semaphore(0)
    finals = []

    def sink(item):
        if isinstance(item, BaseException) or item.finish_reason is not None:
            finals.append(item)
            done.release()

    total = len(prompt_ids) * waves
    lengths = request_lengths(total, max_tokens, spread)

    def request(i):
        return GenerationRequest(
            f"bench-{i}",
            tuple(prompt_ids[i % len(prompt_ids)]),
            SamplingOptions(
                temperature=temperature, max_tokens=lengths[i], seed=i if seeded else None, ignore_eos=True
            ),
            verify,
            response_format=response_format,
        )

    sched = engine.scheduler
    # The previous run's last round may still be closing its timers after its last chunk: wait
    # until the scheduler has retired every row, then start counting afresh.
    while sched.load()["running"]:
        time.sleep(0.001)
    sched.timers.reset()
    t0 = time.perf_counter()
    sent = min(clients, total)
    for i in range(sent):
        engine.submit(request(i), sink)
    for _ in range(total):
        done.acquire()
        if on_request:
            on_request()
        if sent < total:
            engine.submit(request(sent), sink)
            sent += 1
    seconds = time.perf_counter() - t0
    # The last chunk reaches its sink inside the last round: the scheduler then closes that round's
    # timers and records its prediction. Rows retire after that, so once none is running, the
    # timers hold every round of this run (a snapshot taken at once missed the last round's
    # prediction, inflating the predicted speed of runs of few rounds by up to a round in three).
    while sched.load()["running"]:
        time.sleep(0.0005)
    errors = [f for f in finals if isinstance(f, BaseException)]
    if errors:
        raise errors[0]
    stats = [f.stats for f in finals]
    return sum(f.completion_tokens for f in finals), seconds, stats, sched.timers.snapshot()
