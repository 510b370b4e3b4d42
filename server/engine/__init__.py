"""Engines: things that turn a GenerationRequest into a stream of GenerationChunks.

`protocol` is torch-free so the gateway can import it without loading model code.

Embedded engine modules (torch; import them only where the engine runs):
    llama.py       Llama/Qwen2 decoder over a preallocated per-row KV cache (kv_cache.py).
    row.py         one request's decoding state, stop rules and chunk emission (detokenize.py).
    step.py        one batched round: N draft forwards, one target forward, one verifier.verify.
    scheduler.py   continuous batching on a thread: admit, prefill, step, retire.
    embedded.py    EmbeddedEngineConfig / EmbeddedEngine: the protocol implementation.
    bench.py       `dialspec bench engine`.
"""
