"""The plugin's extra memory per verify step stays within one `[B, N, V]` float32 buffer.

Measured in bytes of allocations by torch's profiler (tests/plugin_memory.py explains how and why
that is sound), never by timing. Two views: the step's peak through SGLang's real `eagle_sample`
with the hooks minus the same step bare (the plugin's extra peak), and each of the plugin's two
`[B, N, V]` passes on its own. B = 48, N = 5 as in the issue; V = 32768 keeps the CPU run short:
every large allocation scales with V, so the ratio to the buffer does not depend on it
(docs/sglang.md has V = 131072, measured with `python -m tests.plugin_memory`).
"""

from __future__ import annotations

import pytest

from tests.plugin_memory import KINDS, body_peaks, measure

B, N, V = 48, 5, 32768
BUFFER = B * N * V * 4  # one [B, N, V] float32 buffer, in bytes


@pytest.mark.slow
def test_step_peak_with_the_hooks_exceeds_stock_by_at_most_one_buffer(monkeypatch):
    result = measure(B, N, V, monkeypatch)
    assert set(result) == set(KINDS)
    for kind, (stock, hooked) in result.items():
        assert stock > BUFFER  # the measurement sees SGLang's own step (softmax over B·(N+1)·V)
        assert hooked - stock <= BUFFER, f"{kind}: extra {hooked - stock} bytes > {BUFFER}"


@pytest.mark.parametrize("b, n", [(48, 5), (1, 5), (2, 2), (7, 3)])
def test_each_pass_allocates_at_most_one_buffer(b, n):
    buffer = b * n * V * 4
    for name, peak in body_peaks(b, n, V).items():
        assert 0 < peak <= buffer, f"{name}: {peak} bytes for a {buffer}-byte buffer"
