"""Log-probabilities of the law each emitted token was drawn from (requests with `logprobs`).

The law at a token's position, by how the round produced it (`row.py`'s provenance):
    an accepted draft, or the correction at the first rejection (position i < N):
        ν_i = w_i·p_i + (1−w_i)·q_i. Speculative verification emits exactly ν at every such
        position whatever the outcome (docs/algorithm.md), so this is the law of the token there.
    the token after N accepted drafts (the bonus), or an N = 0 round's only token:
        ν = w·p_N + (1−w)·q_bonus for rows that drew it from ν (`round.bonus`), else p_N (w = 1
        rows, and adaptive w < 1 rows by default: `RowMode.draws_nu`).
    a draft-only round's token (quality 0): q_i, which is ν at w = 0.
All are taken after the row's sampling transform (temperature, top-k, top-p): the law actually
sampled. Greedy rows report the temperature-1 law whose argmax they took. Only ensemble rows are
served (baseline policies emit a law that is not ν; `engine.make_row` refuses them).

Cost: nothing for rows that do not ask; for those that do, one `[T, V]` log and one top-k over their
T tokens of the round, read back in one transfer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from server.engine.protocol import LOGPROB_FLOOR
from verifier import ensemble_mix


class RawLogprob(NamedTuple):
    """One emitted token's log-probability and its law's most likely (token id, log-prob) pairs."""

    logprob: float
    top: list[tuple[int, float]]


def wanting(rows) -> list[int]:
    """Indices of the rows that asked for log-probs."""
    return [i for i, row in enumerate(rows) if row.request.logprobs is not None]


def speculative_laws(b, d, s, out, weights: list[list[float]]) -> dict[int, list[torch.Tensor]]:
    """Per row that asked, the law `[V]` of each token the round emits for it (module doc).
    `b`, `d`, `s`, `out`: the round's batch, drafts, scores and outcome (`round.py`); `weights`:
    w per row and tested position."""
    n, laws = b.n, {}
    for i in wanting(b.rows):
        row_laws = []
        for j in range(out.num_accepted[i] + 1):
            if j < n:
                row_laws.append(ensemble_mix(s.probs[i, j], d.probs[i, j], weights[i][j]))
            else:
                row_laws.append(out.bonus_laws.get(i, s.probs[i, n]))
        laws[i] = row_laws
    return laws


def draft_only_laws(b, d) -> dict[int, list[torch.Tensor]]:
    """Per row that asked, its draft-only round's laws q_1..q_n `[V]` each."""
    return {i: list(d.probs[i].unbind(0)) for i in wanting(b.rows)}


def gather(rows, laws: dict[int, list[torch.Tensor]], tokens: dict[int, list[int]]) -> dict[int, list]:
    """The emitted tokens' log-probs and their laws' top-k (k = the largest any row asked for), in
    one device read; per row, one entry per token of `tokens[i]` (the round's emitted tokens)."""
    if not laws:
        return {}
    order = list(laws)
    stacked = torch.stack([law for i in order for law in laws[i]])  # [T, V]
    logp = stacked.float().log().clamp_min(LOGPROB_FLOOR)  # [T, V]; log 0 = -inf -> the floor
    ids = torch.tensor([t for i in order for t in tokens[i]], device=logp.device)  # [T]
    chosen = logp.gather(1, ids.unsqueeze(1))  # [T, 1]
    k = max(rows[i].request.logprobs for i in order)
    top = logp.topk(k, dim=-1) if k else None  # values, indices [T, k]
    parts = [chosen] + ([top.values, top.indices.to(logp.dtype)] if top is not None else [])
    host = torch.cat(parts, dim=1).tolist()  # [T, 1 + 2k]; token ids < 2^24 are exact in float32
    out, at = {}, 0
    for i in order:
        want = rows[i].request.logprobs
        entries = []
        for _ in laws[i]:
            line = host[at]
            at += 1
            alternatives = [(int(line[1 + k + c]), line[1 + c]) for c in range(want)]
            entries.append(RawLogprob(line[0], alternatives))
        out[i] = entries
    return out
