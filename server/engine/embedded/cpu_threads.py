"""The scheduler thread's intra-op CPU threads: how many, and running a block with them.

OpenMP settings are per thread, so setting them on the scheduler thread leaves callers' threads
as they were (the scheduler sets `Models.num_threads` on its own thread when it starts).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

# Targets below this many parameters run with one intra-op thread on CPU: their matmuls are too
# small to split, and their OpenMP barriers cost milliseconds on a busy host (measured: 2.6 ms vs
# 0.1 ms per 256x512 linear with 2 threads on a loaded 2-core box).
_SMALL_TARGET_PARAMS = 50_000_000


def scheduler_threads(device: torch.device, configured: int | None, target_path: Path) -> int | None:
    """`configured`, else 1 for a small target on CPU, else None (torch's default)."""
    if configured is None and device.type == "cpu" and _num_params(target_path) < _SMALL_TARGET_PARAMS:
        return 1
    return configured


def _num_params(path: Path) -> int:
    from server.engine.embedded.model.llama import ModelArgs

    a = ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    per_layer = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    per_layer += a.num_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    return a.num_layers * per_layer + a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Run the block with `threads` intra-op threads on this thread (restored after)."""
    if not threads:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)
