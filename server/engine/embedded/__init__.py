"""The embedded engine: a draft + target pair in this process (torch).

Read from the top down; each layer imports only the ones below it:
    engine.py       `EmbeddedEngine` / `EmbeddedEngineConfig`: the protocol implementation.
    scheduler.py    continuous batching on a thread: admit, prefill, plan N, step, retire.
    prefill.py      prompts into the caches, each request's first token from the same forward.
    round.py        one batched speculative round as stages (draft, score, weights, check, bonus).
    draft_only.py   quality 0 (ν = q): rounds of the draft alone.
    row.py          one request's decoding state and its chunks (detokenize.py: text, stop strings).
    models.py       what a round runs on: the pair, its caches, the head, the planner.
    timers.py       per-phase round timings.
    dtype_choice.py `--dtype auto`.
    planner/        the draft length N per row and round, and the measured cost model it reads.
    model/          the lean Llama/Qwen2 decoder and its KV cache.
    bench/          `dialspec bench engine`.
"""
