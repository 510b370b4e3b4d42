"""Where each request's hidden states sit in SGLang 0.5.23's flat batches, and a per-request store.

SGLang runs every forward on a flat token axis: the final norm's output (the LM-head input) is
`[T, H]` with T the tokens of all requests in the batch, plus padding rows at the end (DP,
graphs). Which rows belong to which request depends on the forward mode of the `ForwardBatch`
(`sglang.srt.model_executor.forward_batch_info`); for STANDALONE, topk = 1, CUDA graphs off:

    EXTEND (draft prefill extend)   T = Σ extend_seq_lens; request r owns rows
                                    start[r] .. start[r] + extend_seq_lens[r] − 1, start = the
                                    exclusive cumulative sum. Its last row is the state that
                                    produced draft 1 of the request's first round
                                    (`EagleDraftWorker._draft_extend_for_prefill` samples it there).
    DRAFT_EXTEND_V2 (draft extend   T = Σ extend_seq_lens, each = front + N + 1 (front =
      after a verify)               `spec_info.num_front_tokens`, normally 0); request r's
                                    accepted tokens are rows start[r] + front + 0 .. accept[r] − 1
                                    (accept = `spec_info.num_accept_tokens`, drafts + bonus). The
                                    last of them (the bonus token) produced draft 1 of the next
                                    round (SGLang's own `select_index`).
    DECODE (draft steps in          T = B: row r. Step j (j = 1 .. N−1) produced draft j + 1.
      `EagleDraftWorker.draft_forward`)
    TARGET_VERIFY (target)          T = B·(N+1): rows r·(N+1) + i, i < N, score drafts 1 .. N.

Requests join (after their prefill), leave (finished, aborted, retracted) and change order
between batches, so states are keyed by request id (`ForwardBatch.rids` / `Req.rid`), never by
row. `DraftChains` holds, per rid, the draft states since the last draft extend: exactly N of
them when a verify comes (1 from the extend, N − 1 from the decode steps).

No SGLang import: the functions read ForwardBatch attributes by name; the tests build real
ForwardBatch objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

RESET, APPEND = "reset", "append"


def _lengths(device_values: Any, host_values: Any) -> torch.Tensor:
    """Per-request lengths as a tensor, preferring the one SGLang keeps on the device (reading
    it stays on the device; a host list would have to be copied there every forward)."""
    if isinstance(device_values, torch.Tensor):
        return device_values.long()
    if host_values is None:
        raise ValueError("batch carries no lengths for this layout")
    return torch.as_tensor(list(host_values), dtype=torch.long)


def draft_rows(forward_batch: Any) -> tuple[str, torch.Tensor] | None:
    """For a draft-model forward: `(RESET|APPEND, [B] row per request)` of the state that
    produced a draft, in `forward_batch.rids` order; None for modes that produce none (IDLE, ...).
    Rows are computed with device ops from SGLang's device-side lengths (no host read).

    Raises ValueError for layouts the head cannot use (MIXED batches, missing lengths)."""
    mode = forward_batch.forward_mode
    name = getattr(mode, "name", str(mode))
    bs = len(forward_batch.rids)
    if name == "DECODE":
        return APPEND, torch.arange(bs, device=forward_batch.seq_lens.device)
    if name == "EXTEND":
        lens = _lengths(forward_batch.extend_seq_lens, forward_batch.extend_seq_lens_cpu)
        return RESET, lens.cumsum(0) - 1
    if name == "DRAFT_EXTEND_V2":
        spec = forward_batch.spec_info
        lens = _lengths(forward_batch.extend_seq_lens, forward_batch.extend_seq_lens_cpu)
        accept = _lengths(spec.num_accept_tokens, getattr(spec, "num_accept_tokens_cpu", None))
        front = int(getattr(spec, "num_front_tokens", 0) or 0)
        return RESET, lens.cumsum(0) - lens + front + accept.to(lens.device) - 1
    if name == "MIXED":
        raise ValueError("MIXED (chunked prefill + decode) draft batches have no single layout")
    return None


def verify_rows(b: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[B, N]` row indices into a TARGET_VERIFY forward's flat `[B·(N+1) (+pad), H]` output,
    made on `device` (no host copy)."""
    rows = torch.arange(b, device=device).unsqueeze(1) * (n + 1)
    return rows + torch.arange(n, device=device).unsqueeze(0)


class DraftChains:
    """Per request id: the draft states (`[Hd]` each) since its last draft extend.

    `max_age` verify steps without an update drop an entry (a request that left the batch);
    `invalidate` drops entries whose alignment can no longer be trusted.
    """

    def __init__(self, max_age: int = 16):
        self.max_age = max_age
        self.step = 0
        self._chains: dict[str, list[torch.Tensor]] = {}
        self._touched: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def record(self, kind: str, rids: Sequence[str], states: torch.Tensor, rows: torch.Tensor) -> None:
        """`states` is one forward's flat `[T, Hd]` output; `rows[r]` is request r's row."""
        picked = states.index_select(0, rows.to(states.device))  # [B, Hd] (a copy)
        for r, rid in enumerate(rids):
            if kind == RESET:
                self._chains[rid] = [picked[r]]
            elif rid in self._chains:
                self._chains[rid].append(picked[r])
            self._touched[rid] = self.step

    def invalidate(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self._chains.pop(rid, None)
            self._touched.pop(rid, None)

    def advance(self) -> None:
        """One verify step has passed: age out requests nobody touched for `max_age` steps."""
        self.step += 1
        old = [rid for rid, t in self._touched.items() if self.step - t > self.max_age]
        self.invalidate(old)

    def take(self, rids: Sequence[str], n: int) -> tuple[list[torch.Tensor | None], list[bool]]:
        """Per rid: its `[N, Hd]` stacked chain when it holds exactly N states, else None."""
        out, ok = [], []
        for rid in rids:
            chain = self._chains.get(rid)
            good = chain is not None and len(chain) == n
            out.append(torch.stack(chain) if good else None)
            ok.append(good)
        return out, ok
