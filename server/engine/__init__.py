"""Engines: things that turn a GenerationRequest into a stream of GenerationChunks.

Shared by the gateway, training and the SGLang plugin (torch-free unless noted):
    protocol.py    the `Engine` protocol, requests, chunks, stats, errors.
    model_pair.py  where the shipped pair and its prompts are, and their checksums.
    head_store.py  learned heads on disk and the pair fingerprint (torch).

Two rooms, which never import each other (tests/test_layers.py):
    sglang/        the `Engine` over HTTP to an SGLang runtime (no torch).
    embedded/      a draft + target pair in this process (torch; import it only where it runs).
"""
