"""Admission: a new row's prompt into the caches, and its first token from the same forward.

    prefill(models, rows)        one right-padded forward per model over the rows admitted together
    first_tokens(models, rows, h) the first token of each row from the target's state at its last
                                 prompt position: a round with N = 0 (`round.py`) whose target
                                 forward was the prefill

Sampling the first token from the prefill saves plain decoding's first step (a forward of its own
over the last prompt token) for every request, and brings the first token one round earlier.
"""

from __future__ import annotations

import torch

from server.engine.embedded.models import Models
from server.engine.embedded.round import (
    RoundBatch,
    advance,
    attach_logprobs,
    bonus,
    check,
    draft,
    ensemble_weights,
    scores_of,
)
from server.engine.embedded.row import Row

_PREFILL_TOKEN_BUDGET = 8192  # padded prompt tokens per prefill forward (bounds the [R, P, P] mask)


@torch.inference_mode()
def prefill(models: Models, rows: list[Row]) -> None:
    """Fill the caches with each row's prompt and draw its first token.

    The target reads the whole prompt; its state at the last prompt position gives p for the first
    token, drawn here (`first_tokens`): plain decoding's first step comes with the prefill instead
    of costing a forward of its own (as in vLLM and SGLang). The draft reads `prompt[:-1]` when the
    row will surely draft (`RowMode.eager_draft`): the last prompt token is fed with its first proposal,
    or by the first token's bonus step for rows that draw it from ν. Rows that decode from the draft
    alone skip the target; their first token comes from their first draft-only round. Rows admitted
    together share one right-padded forward per model: padding lands past each row's length, where
    it is masked out and later overwritten. With `first_token_from_prefill` off, the target reads
    `prompt[:-1]` too and the first round drafts the first token."""
    dev = models.device
    whole = models.first_token_from_prefill  # else the target reads prompt[:-1] and no token is drawn
    for row in rows:
        row.tlen = 0 if row.mode.draft_only else len(row.seq) - (not whole)  # quality 0 never runs the target
        row.dlen = (
            len(row.seq) - 1 if row.mode.eager_draft else 0
        )  # a lazy draft catches up when it first runs
    todo = sorted(rows, key=lambda row: len(row.seq))
    last_states: dict[int, torch.Tensor] = {}  # id(row) -> the target's state at its last prompt token
    while todo:
        group = [todo.pop()]  # longest first; add rows while the padded batch fits the budget
        while todo and (len(group) + 1) * len(group[0].seq) <= _PREFILL_TOKEN_BUDGET:
            group.append(todo.pop())
        width = len(group[0].seq)
        tokens = torch.tensor(
            [row.seq + [0] * (width - len(row.seq)) for row in group], dtype=torch.long, device=dev
        )  # [R, P]
        slots = torch.tensor([row.slot for row in group], device=dev)  # [R]
        starts = torch.zeros(len(group), dtype=torch.long, device=dev)  # [R]
        drafted = [i for i, row in enumerate(group) if row.mode.eager_draft]
        if drafted and width > 1:
            t, sl, st = _select(drafted, tokens, slots, starts)
            models.draft(t[:, :-1], sl, st, models.draft_cache)
        targeted = [i for i, row in enumerate(group) if not row.mode.draft_only]
        if targeted and not whole:
            if width > 1:
                t, sl, st = _select(targeted, tokens, slots, starts)
                models.target(t[:, :-1], sl, st, models.target_cache)
        elif targeted:
            t, sl, st = _select(targeted, tokens, slots, starts)
            hidden = models.target(t, sl, st, models.target_cache)  # [R', P, Ht]
            for j, i in enumerate(targeted):
                last_states[id(group[i])] = hidden[j, len(group[i].seq) - 1]  # [Ht]
    # One draw for every row, in the order given: `advance` then emits row by row in that order,
    # which the scheduler's fault isolation relies on (the last row that advanced is the one that
    # raised).
    order = [row for row in rows if id(row) in last_states]
    if order:
        first_tokens(models, order, torch.stack([last_states[id(row)] for row in order]))


def _select(idx: list[int], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows `idx` of each tensor (the tensors themselves when idx is every row)."""
    if len(idx) == tensors[0].shape[0]:
        return tensors
    at = torch.tensor(idx, device=tensors[0].device)
    return tuple(t[at] for t in tensors)


def first_tokens(models: Models, rows: list[Row], hidden: torch.Tensor) -> None:
    """Each row's first token from the target's state at its last prompt position `[R, Ht]`: a round
    with N = 0 whose target forward was the prefill (`check`, `bonus`, `advance` as in any round,
    so the token follows the same law: p, or ν for rows that draw it from ν)."""
    b = RoundBatch.of(rows, 0, models.device)
    h = hidden.unsqueeze(1)  # [R, 1, Ht]
    drafts = draft(models, b)  # N = 0: no drafts (a constrained row's mask for its first token)
    scores = scores_of(models, b, drafts, h)  # p [R, 1, V]
    weights, per_position = ensemble_weights(models, b, drafts, scores)
    out = check(b, drafts, scores, weights)
    if any(row.mode.draws_nu for row in rows):
        bonus(models, b, drafts, scores, out)
    attach_logprobs(b, drafts, scores, out, per_position)
    advance(b, out, per_position)
