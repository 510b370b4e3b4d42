"""Prometheus metrics (vLLM-style names under `dialspec:`), one CollectorRegistry per app.

Labels stay low-cardinality: `tier` is a tier name, "custom" (numeric quality), "auto" or
"autoregressive"; the applied w goes to a histogram, never to a label.

Speculative counters (vLLM semantics; a "draft" is one proposal round):
    dialspec:spec_decode_num_drafts_total{tier}
    dialspec:spec_decode_num_draft_tokens_total{tier}
    dialspec:spec_decode_num_accepted_tokens_total{tier}
    dialspec:spec_decode_num_accepted_tokens_per_pos_total{position}
    dialspec:draft_only_tokens_total{tier}   tokens from the draft alone (quality 0: no target)

Useful PromQL:
    acceptance rate (accepted / proposed draft tokens), per tier:
        sum by (tier) (rate(dialspec:spec_decode_num_accepted_tokens_total[5m]))
      / sum by (tier) (rate(dialspec:spec_decode_num_draft_tokens_total[5m]))
    mean accepted length (tokens emitted per target forward):
        1 + sum by (tier) (rate(dialspec:spec_decode_num_accepted_tokens_total[5m]))
          / sum by (tier) (rate(dialspec:spec_decode_num_drafts_total[5m]))
    acceptance at draft position i (conditional on reaching it, vLLM style):
        sum by (position) (rate(dialspec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}[5m]))
      / scalar(sum(rate(dialspec:spec_decode_num_drafts_total[5m])))
    share of all generated tokens served by the draft alone (quality 0 on an adaptive engine):
        sum(rate(dialspec:draft_only_tokens_total[5m])) / sum(rate(dialspec:generation_tokens_total[5m]))
    p99 time to first token:
        histogram_quantile(0.99, sum by (le) (rate(dialspec:time_to_first_token_seconds_bucket[5m])))

Brownout (brownout.py; `requested_tier` / `served_tier` take the `tier` label's values):
    dialspec:brownout_level                         0 = off or not degraded, up to the ladder's depth
    dialspec:brownout_degraded_seconds_total        time spent at a level above 0
    dialspec:requests_by_quality_total{requested_tier, served_tier}
    dialspec:generation_tokens_by_quality_total{requested_tier, served_tier}
    dialspec:request_queue_time_seconds             arrival to admission (the part brownout guards)

    share of the last hour spent degraded:
        rate(dialspec:brownout_degraded_seconds_total[1h])
    requests per second by (requested -> served) tier:
        sum by (requested_tier, served_tier) (rate(dialspec:requests_by_quality_total[5m]))
    p99 queue time:
        histogram_quantile(0.99, sum by (le) (rate(dialspec:request_queue_time_seconds_bucket[5m])))

Health (the alerts of deploy/prometheus/rules/dialspec-alerts.yml read these):
    dialspec:ready                       1 when /ready would answer 200, else 0 (set at scrape)
    dialspec:acceptance_floor{tier}      the lowest acceptance rate the tier's w allows for any
                                         pair (`acceptance_floor` below); a tier's acceptance rate
                                         under it means the dial is not applied (e.g. a runtime
                                         serving stock SGLang without the plugin)

More PromQL:
    readiness of every gateway:
        dialspec:ready
    acceptance rate minus its floor, per tier (its expectation is >= 0 while the dial works):
        sum by (tier) (rate(dialspec:spec_decode_num_accepted_tokens_total[15m]))
      / sum by (tier) (rate(dialspec:spec_decode_num_draft_tokens_total[15m]))
      - on (tier) max by (tier) (dialspec:acceptance_floor)

Latency definitions: TTFT runs from request arrival (queueing included) to the first generated
text; inter-token latency is the gap between successive output chunks of one sequence (one chunk per
verify round, which may carry several tokens: vLLM records it per engine step the same way);
e2e from arrival to the last chunk.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from server.engine.protocol import SpecStats

# `*_created` series double the page and no dashboard reads them (vLLM disables them too).
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
_W_BUCKETS = tuple(round(0.1 * i, 1) for i in range(11))  # 0.0 .. 1.0
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class GatewayMetrics:
    """All metrics of one gateway app. `registry` is private to the app (tests build many apps)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "dialspec:"
        self.num_drafts = Counter(
            p + "spec_decode_num_drafts", "Speculative proposal rounds.", ["tier"], registry=r
        )
        self.num_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Draft tokens proposed.", ["tier"], registry=r
        )
        self.num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["tier"], registry=r
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first output text, seconds.",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Gap between successive output chunks of a sequence, seconds.",
            ["tier"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to completion, seconds.",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.weight = Histogram(
            p + "ensemble_weight",
            "Mean ensemble weight w applied per sequence.",
            buckets=_W_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            p + "request_prompt_tokens", "Prompt length per request.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Completion tokens generated.", ["tier"], registry=r
        )
        self.draft_only_tokens = Counter(
            p + "draft_only_tokens",
            "Tokens drawn from the draft alone (quality 0, w = 0: the target does not run).",
            ["tier"],
            registry=r,
        )
        self.prompt_tokens_total = Counter(p + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.success = Counter(
            p + "request_success", "Finished sequences by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            p + "request_errors", "Requests answered with an error, by status.", ["status"], registry=r
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to admission (a running slot), seconds.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.brownout_level = Gauge(
            p + "brownout_level", "Brownout level now (0 = serving every request as asked).", registry=r
        )
        self.degraded_seconds = Counter(
            p + "brownout_degraded_seconds", "Seconds spent at a brownout level above 0.", registry=r
        )
        pair = ["requested_tier", "served_tier"]
        self.requests_by_quality = Counter(
            p + "requests_by_quality", "Admitted requests by requested and served tier.", pair, registry=r
        )
        self.tokens_by_quality = Counter(
            p + "generation_tokens_by_quality",
            "Completion tokens by requested and served tier.",
            pair,
            registry=r,
        )
        self.ready = Gauge(p + "ready", "1 when /ready answers 200 (set at each scrape).", registry=r)
        self.acceptance_floor = Gauge(
            p + "acceptance_floor",
            "Lowest accepted/proposed draft-token ratio the tier's ensemble weight w allows.",
            ["tier"],
            registry=r,
        )
        self.running = Gauge(p + "num_requests_running", "Requests admitted and generating.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for admission.", registry=r)

    def set_acceptance_floors(self, tier_weights: dict[str, float], max_num_draft: int) -> None:
        """`acceptance_floor(w, N)` for every configured tier at the engine's largest N."""
        for tier, w in tier_weights.items():
            self.acceptance_floor.labels(tier=tier).set(acceptance_floor(w, max_num_draft))

    def bind_load(self, admission, brownout) -> None:
        """Gauges read the admission controller and brownout at scrape time (never stale)."""
        self.running.set_function(lambda: admission.running_requests)
        self.waiting.set_function(lambda: admission.waiting_requests)
        self.brownout_level.set_function(lambda: brownout.level)

    def record_sequence(
        self, tier: str, stats: SpecStats | None, completion_tokens: int, finish: str
    ) -> None:
        """One finished sequence (one choice)."""
        self.success.labels(finish_reason=finish).inc()
        self.generation_tokens.labels(tier=tier).inc(completion_tokens)
        if stats is None:
            return
        if stats.draft_only_tokens:
            self.draft_only_tokens.labels(tier=tier).inc(stats.draft_only_tokens)
        if stats.drafts:
            self.num_drafts.labels(tier=tier).inc(stats.drafts)
            self.num_draft_tokens.labels(tier=tier).inc(stats.draft_tokens)
            self.num_accepted_tokens.labels(tier=tier).inc(stats.accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_position):
            if count:
                self.accepted_per_pos.labels(position=str(pos)).inc(count)
        if stats.mean_weight is not None:
            self.weight.observe(stats.mean_weight)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def acceptance_floor(w: float, num_draft: int) -> float:
    """The smallest expected accepted/proposed ratio of ensemble verification at weight w with
    N = num_draft drafts per round, for any pair.

    Each draft x ~ q is accepted with probability sum_x min(q(x), ν(x)) >= 1 - w, since
    ν = w·p + (1-w)·q >= (1-w)·q pointwise; the chain stops at the first rejection, so position
    k (1-based) is accepted with probability >= (1-w)^k, and the ratio counts N proposed:
    (1/N)·sum_{k=1..N} (1-w)^k. A smaller N only raises it, so the largest N gives a floor for
    adaptive rounds too. Stock SGLang ignores w (it verifies against p alone: w = 1), so a pair
    whose own acceptance is below this floor shows the plugin missing."""
    a = 1.0 - w
    return sum(a**k for k in range(1, num_draft + 1)) / num_draft
