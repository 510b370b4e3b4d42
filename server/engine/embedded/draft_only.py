"""Quality 0 without the target: a static w = 0 row decodes from the draft alone.

At w = 0 the ensemble is the draft (ν = w·p + (1−w)·q = q), so every draft is accepted and the
bonus is drawn from q: the speculative round's target forward decides nothing. It still costs a
target forward per round (and a target prefill per prompt), which on a real pair makes quality 0
slower than tiers that verify (measured on the Qwen2.5-0.5B → 1.5B shapes: 1.51× plain decoding
at quality 0 against 1.73× at lite). A draft-only round is the draft's own autoregressive
decoding, n tokens per round:

    batch  = RoundBatch.of(rows, n)   the rows' coins (the same per-row streams as any round)
    drafts = step.draft(models, batch) n draft forwards: x [R, n], each x_i ~ q_i under the row's
                                       sampling transform (argmax for greedy rows)
    emit                              the n tokens, read back once; the draft cache has consumed
                                      the pending tokens and x_1..x_{n-1} (x_n is pending next)

Tokens are ν's exactly: x_i ~ q(· | prefix) is the ensemble's law at w = 0, position by position.
n (`DraftPlanner.assign`) is the engine's max draft length capped by the most tokens a row of the
group has left: more tokens per round spread the round's fixed costs, while the round stays as
long as a speculative one. Rows with fewer left keep what they need and stop (`Row.emit_tokens`);
the draws past their end cost a little compute, where a round of their own would cost n fixed
draft steps more. The target cache is never filled (`Row.tlen` stays 0), so only rows that can
never need the target run here (`RowMode.draft_only`: static w = 0, ensemble, not pinned to an N).
"""

from __future__ import annotations

import torch

from server.engine.embedded import logprobs
from server.engine.embedded.models import Models
from server.engine.embedded.round import RoundBatch, draft
from server.engine.embedded.row import Row
from server.engine.embedded.timers import Stage, StepTimers


@torch.inference_mode()
def run_draft_only_round(models: Models, rows: list[Row], n: int, timers: StepTimers) -> float:
    """One draft-only round of `n` >= 1 tokens for `rows` (all `draft_only`); emits them and
    returns the round's seconds."""
    if n < 1:
        raise ValueError(f"a draft-only round emits at least one token, got n={n}")
    dev = models.device
    last = timers.last = {}
    with timers.phase(Stage.ROUND, dev):
        batch = RoundBatch.of(rows, n, dev)
        with timers.phase(Stage.DRAFT_ONLY, dev, count=n):
            drafts = draft(models, batch, last_mask=False)
        tokens = drafts.tokens.tolist()  # [R][n], one device read
        laws = logprobs.draft_only_laws(batch, drafts)
        lps = logprobs.gather(rows, laws, {i: tokens[i] for i in laws})
        for i, (row, toks) in enumerate(zip(rows, tokens, strict=True)):
            row.dlen = len(row.seq) + n - 1
            row.record_draft_only(n)
            if row.grammar is not None:  # every draft is kept: its matcher took them all
                row.grammar.settle(n, None)
            row.emit_tokens(toks, lps.get(i), draft_only=True)
    timers.draft_tokens += n * len(rows)
    timers.row_rounds += len(rows)
    if models.planner is not None:
        models.planner.learn_draft_only(batch, last)
    return last[Stage.ROUND]
