"""The lean Llama/Qwen2 decoder (`llama.py`) and its preallocated per-row KV cache (`kv_cache.py`)."""
