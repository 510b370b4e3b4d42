"""Preallocated per-row KV cache for ragged continuous batching.

Terms
    slot        a row index in `[0, max_batch)`; one live request owns one slot for its lifetime.
    length      per slot, how many leading positions of the cache hold valid keys/values. Rows in
                one batch sit at different lengths and advance by their own accepted counts.
    rollback    speculative positions that were written but rejected are discarded by lowering
                `length`; the stale entries past it are masked out by position and overwritten later.

Layout `[layers, max_batch, kv_heads, max_seq, head_dim]` (the SDPA layout, so a batch's keys are a
slice or a gather over the slot dimension, never a transpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    layers: int
    max_batch: int
    kv_heads: int
    max_seq: int  # max_context plus speculative slack (N + 2 positions written ahead)
    head_dim: int


class KVCache:
    """Keys and values for every layer and slot; lengths are tracked by the scheduler."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str):
        dims = (shape.layers, shape.max_batch, shape.kv_heads, shape.max_seq, shape.head_dim)
        self.shape = shape
        self.k = torch.zeros(dims, dtype=dtype, device=device)  # [L, Bmax, Hkv, S, D]
        self.v = torch.zeros(dims, dtype=dtype, device=device)  # [L, Bmax, Hkv, S, D]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        single: tuple[int, int] | None = None,
    ) -> None:
        """Store `k, v` `[R, Hkv, T, D]` for rows `slots` `[R]` at absolute `positions` `[R, T]`.

        `single=(slot, start)` for a one-row call: a plain slice copy, no index arithmetic."""
        if single is not None:
            (slot, start), t = single, positions.shape[1]
            self.k[layer, slot, :, start : start + t] = k[0]
            self.v[layer, slot, :, start : start + t] = v[0]
            return
        b_idx = slots.view(-1, 1)  # [R, 1], broadcasts against positions [R, T]
        # Advanced indices separated by a slice put their dims first: the target is [R, T, Hkv, D].
        self.k[layer][b_idx, :, positions] = k.transpose(1, 2)
        self.v[layer][b_idx, :, positions] = v.transpose(1, 2)

    def read(
        self, layer: int, slots: torch.Tensor, seq_len: int, contiguous: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[R, Hkv, seq_len, D]` of rows `slots`.

        `contiguous` means `slots == arange(R)`: then this is a view (no copy), the common case
        at batch 1 and whenever the low slots are the busy ones.
        """
        if contiguous:
            r = slots.shape[0]
            return self.k[layer, :r, :, :seq_len], self.v[layer, :r, :, :seq_len]
        return self.k[layer][slots, :, :seq_len], self.v[layer][slots, :, :seq_len]
