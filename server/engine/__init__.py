"""Engines: things that turn a GenerationRequest into a stream of GenerationChunks.

`protocol` is torch-free so the gateway can import it without loading model code.
"""
