"""The OpenAI-compatible HTTP gateway with the quality dial.

Torch-free by design: it speaks only `server.engine.protocol`, so importing it (and serving an
engine that lives elsewhere, e.g. SGLang) never loads model code. Entry points: `create_app` in
`app.py`, `dialspec serve` in `serve.py`.
"""
