"""`dialspec loadtest`: a serving benchmark for dialspec and any OpenAI-compatible server.

Modules (one concept each):
    stats      percentiles and the mean/median/p90/p99 summary
    tiers      the tier mix (`lite:0.3,standard:0.4,pro:0.3`) and its seeded assignment
    schedule   load shapes: fixed concurrency, open-loop Poisson arrivals, sweeps
    prompts    prompt sources: the embedded task suite or a JSONL file
    sse        server-sent-events parsing of an OpenAI streaming response
    client     one streamed request, timed, with its failure kind
    runner     one bounded load phase (request count AND duration)
    scrape     Prometheus `/metrics` scrape and the per-tier counter delta
    summary    per-request records -> the benchmark numbers (overall and per tier)
    render     the terminal report (rich)
    plots      PNG + SVG plots (matplotlib Agg)
    cli        `dialspec loadtest` arguments, errors and orchestration

Terms used throughout:
    TTFT   time to first token: request sent -> first chunk carrying output text.
    ITL    inter-token latency: gap between successive output chunks of one response. With
           speculative decoding one chunk may carry several tokens (one chunk per verify round),
           as in `vllm bench serve`.
    TPOT   time per output token, excluding the first: (e2e - TTFT) / (output tokens - 1).
    e2e    request sent -> end of stream (`[DONE]`).
    output tokens  `usage.completion_tokens` from the final usage chunk (never counted from chunks).
    acceptance rate        accepted draft tokens / proposed draft tokens.
    mean accepted length   1 + accepted draft tokens / drafts (tokens emitted per target forward).
"""
