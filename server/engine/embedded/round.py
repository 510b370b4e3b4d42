"""One batched decoding round for rows that share a draft length N, as small stages:

    batch  = RoundBatch.of(rows, n)          per-row tensors: slots, sampling params, greedy, coins
    drafts = draft(models, batch)            N draft forwards: x [R, N], q [R, N, V], h_draft [R, N, Hd]
    scores = score(models, batch, drafts)    ONE target forward over [pending, x_1..x_N]:
                                             p [R, N+1, V], h_target [R, N+1, Ht]
    w      = ensemble_weights(...)           static w per row, or the learned head's w_t [R, N]
    out    = check(batch, drafts, scores, w) one `verifier.verify` call for the whole group, read
                                             back to the host once (`Outcome`)
    bonus(models, batch, drafts, scores, out)  rows that draw from ν (`RowMode.draws_nu`: strict
                                             rows with w < 1) and accepted all N drafts redraw
                                             their bonus from ν: one more draft step gives q there
    advance(batch, out, w)                   each row appends its k + 1 tokens; caches roll back
                                             by length (stale entries are masked, then overwritten)

N = 0 is the same path: no draft forwards, a 1-position target forward, and `verify` with N = 0
draws the token from p with the row's first verify coin (rows that draw from ν then take the
draft's one step in `bonus` instead). The draft length is decided before a round by the scheduler
(`planner.draft_planner.DraftPlanner`); a round only ever sees one N. Accepted drafts and
corrections follow ν whatever N; the bonus and N = 0 tokens follow ν for `draws_nu` rows, else p.

Terms
    pending   the tokens a cache has not consumed yet: 1 for the target (the last token); for the
              draft 1, 2 when every draft of the last round was accepted without a bonus step, or
              more after rounds without drafts (its `lag`; fed in a catch-up forward first).
    h_draft   `[R, N, Hd]` final-norm draft states at the positions that produced each draft token.
    h_target  `[R, N+1, Ht]` final-norm target states at the positions scoring each draft token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from server.engine.embedded import forced, grammar, logprobs
from server.engine.embedded.models import Models
from server.engine.embedded.row import Row
from server.engine.embedded.timers import Stage, StepTimers
from verifier import PolicyBatch, PolicyKind, ensemble_mix, logits_to_probs, pick_tokens, tv_estimates, verify
from verifier.head import position_stats, wants_states, wants_stats


def _param(rows: list[Row], name: str, device, dtype=torch.float32):
    """A per-row parameter: a Python scalar when every row agrees (the sampling transform then
    skips per-row broadcasting, and top-k/top-p skip their sorts when off), else a `[R]` tensor."""
    values = [getattr(r, name) for r in rows]
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device)  # [R]


@dataclass
class RoundBatch:
    """The per-row inputs of one round, built once."""

    rows: list[Row]
    n: int  # draft length, 0 = no drafts
    device: torch.device
    slots: torch.Tensor  # [R] cache slots
    contiguous: bool  # slots == arange(R): cache reads are views
    greedy: bool | torch.Tensor  # True/False when the group agrees, else a [R] mask
    temperature: float | torch.Tensor  # scalar or [R]
    top_k: int | torch.Tensor
    top_p: float | torch.Tensor
    u_draft: torch.Tensor  # [R, N] the rows' coins for sampling drafts
    u_verify: torch.Tensor  # [R, N+1] their coins for the acceptance tests and the final draw
    # Catch-up draft forwards this round ran (`_feed_pending`): (tokens M, seconds) each. Shared
    # with `subset`s (a bonus step's catch-up is the round's); the planner learns them apart from
    # the draft steps, whose per-step time they would otherwise inflate.
    catch_ups: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def of(cls, rows: list[Row], n: int, device: torch.device) -> RoundBatch:
        greedy = _param(rows, "greedy", device, torch.bool)
        # Each row draws from its own stream, so its tokens do not depend on who shares the batch.
        coins = torch.stack([row.uniforms(2 * n + 1) for row in rows]).to(device)  # [R, 2N+1]
        return cls(
            rows=rows, n=n, device=device,
            slots=torch.tensor([row.slot for row in rows], device=device),
            contiguous=[row.slot for row in rows] == list(range(len(rows))),
            greedy=greedy,
            temperature=_param(rows, "temperature", device),
            top_k=_param(rows, "top_k", device, torch.long),
            top_p=_param(rows, "top_p", device),
            u_draft=coins[:, :n], u_verify=coins[:, n:],
        )  # fmt: skip

    def subset(self, idx: list[int]) -> RoundBatch:
        """The same round restricted to rows `idx` (same coins: nothing is drawn again)."""
        if idx == list(range(self.size)):
            return self
        at = torch.tensor(idx, device=self.device)

        def pick(v):
            return v[at] if isinstance(v, torch.Tensor) else v

        rows = [self.rows[i] for i in idx]
        return replace(
            self, rows=rows, slots=self.slots[at], contiguous=[r.slot for r in rows] == list(range(len(idx))),
            greedy=pick(self.greedy), temperature=pick(self.temperature), top_k=pick(self.top_k),
            top_p=pick(self.top_p), u_draft=self.u_draft[at], u_verify=self.u_verify[at],
        )  # fmt: skip

    @property
    def size(self) -> int:
        return len(self.rows)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' sampling transform; p and q go through the same one (verification needs it)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)

    def column(self, values: list, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)  # [R]


@dataclass
class Drafts:
    tokens: torch.Tensor  # [R, N] x_i ~ q_i
    probs: torch.Tensor  # [R, N, V] q
    hidden: torch.Tensor | None  # [R, N, Hd] states that produced each draft (N >= 1)
    constrained: list[int] = field(default_factory=list)  # rows with a grammar (`grammar.py`)
    masks: list[torch.Tensor] = field(default_factory=list)  # per position t: [R', V] allowed


@dataclass
class Scores:
    probs: torch.Tensor  # [R, N+1, V] p
    hidden: torch.Tensor  # [R, N+1, Ht]


@dataclass
class Outcome:
    """A round's verdict on the host (one device read): per row k, its N+1 token slots (drafts,
    then the correction or bonus, then padding), acceptance probabilities and TV estimates of
    its tested positions (drafts up to and including the first rejection)."""

    num_accepted: list[int]
    tokens: list[list[int]]
    accept_probs: list[list[float]]
    tv: list[list[float]]  # empty for greedy rows (their drafts are argmaxes, not draws from q)
    bonus_rows: list[int]  # rows that took a bonus draft step (see `bonus`)
    bonus_weights: list[float] = field(default_factory=list)  # their w at the bonus position
    bonus_laws: dict[int, torch.Tensor] = field(default_factory=dict)  # ν [V] they drew from, if asked
    logprobs: dict[int, list] = field(default_factory=dict)  # per row that asked (`logprobs.py`)


def _feed_pending(models: Models, b: RoundBatch) -> torch.Tensor:
    """Feed each row's pending tokens to the draft; its state at the last one `[R, Hd]`.

    Rows 1 or 2 behind share one right-padded forward (each reads its own last real position);
    rows further behind first catch up on all but their last pending token, so a long lag never
    pads the others."""
    pending = [row.seq[row.dlen :] for row in b.rows]
    lagging = [i for i, p in enumerate(pending) if len(p) > 2]
    for group in _catch_up_groups(b, pending, lagging, models.draft_cache.shape.max_seq):
        t0 = time.perf_counter()
        sub = b.subset(group)
        width = max(len(pending[i]) - 1 for i in group)
        tokens = sub.column([pending[i][:-1] + [0] * (width - len(pending[i]) + 1) for i in group])
        models.draft(tokens, sub.slots, sub.column([b.rows[i].dlen for i in group]), models.draft_cache)
        for i in group:
            pending[i] = pending[i][-1:]
        if b.device.type == "cuda":  # timed where its kernels run (catch-ups are rare: once a request)
            torch.cuda.synchronize(b.device)
        b.catch_ups.append((len(group) * width, time.perf_counter() - t0))
    width = max(len(p) for p in pending)
    tokens = b.column([p + [p[-1]] * (width - len(p)) for p in pending])  # [R, T0]
    starts = b.column([len(row.seq) - len(p) for row, p in zip(b.rows, pending, strict=True)])  # [R]
    hidden = models.draft(tokens, b.slots, starts, models.draft_cache, b.contiguous)  # [R, T0, Hd]
    return hidden[torch.arange(b.size, device=b.device), b.column([len(p) - 1 for p in pending])]


def _catch_up_groups(b: RoundBatch, pending: list, lagging: list[int], max_seq: int) -> list[list[int]]:
    """The lagging rows' catch-up forwards: one for all of them, padded on the right to the longest
    lag, except rows whose padding would run past the cache's end (a row near `max_context` beside
    one that never fed the draft, e.g. an adaptive w = 1 row drafting for the first time): each of
    those gets a forward of its own. Padding keys are overwritten later, but writes past `max_seq`
    are out of bounds (an IndexError on CPU, a device-side assert that kills the CUDA context)."""
    if not lagging:
        return []
    width = max(len(pending[i]) - 1 for i in lagging)
    together = [i for i in lagging if b.rows[i].dlen + width <= max_seq]  # the longest lag always fits
    return [together] + [[i] for i in lagging if i not in together]


def draft(models: Models, b: RoundBatch, last_mask: bool = True) -> Drafts:
    """N batched draft forwards: the pending tokens first, then one proposal at a time. Rows with
    a grammar draw each proposal from the masked q and their matcher takes it; their masks per
    position (and after the last proposal, for p_N and the bonus, unless not `last_mask`) are kept."""
    r, n = b.size, b.n
    g = grammar.constrained(b.rows)
    if n == 0:
        empty = torch.zeros(r, 0, dtype=torch.long, device=b.device)  # [R, 0]
        q = torch.zeros(r, 0, models.draft.args.vocab_size, device=b.device)
        return Drafts(empty, q, None, g, [grammar.allowed_now(b.rows, g)] if g else [])
    h = _feed_pending(models, b)  # [R, Hd]
    base = b.column([len(row.seq) for row in b.rows])  # [R] position of draft token 1
    xs, qs, hs, masks = [], [], [], []
    for i in range(n):
        logits = models.draft.logits(h)  # [R, V]
        if g:
            masks.append(grammar.allowed_now(b.rows, g))
            logits = grammar.mask_logits(logits, g, masks[-1])
        q = b.probs(logits)  # [R, V]
        x = pick_tokens(q, b.greedy, b.u_draft[:, i])  # [R]
        if g:
            for j, token in zip(g, x[g].tolist(), strict=True):
                b.rows[j].grammar.accept(token)
        xs.append(x)
        qs.append(q)
        hs.append(h)
        if i < n - 1:  # the last proposal is fed only by `bonus`, for rows that need q after it
            h = models.draft(x.view(-1, 1), b.slots, base + i, models.draft_cache, b.contiguous)[:, 0]
    if g and last_mask:
        masks.append(grammar.allowed_now(b.rows, g))
    return Drafts(torch.stack(xs, 1), torch.stack(qs, 1), torch.stack(hs, 1), g, masks)


def score(models: Models, b: RoundBatch, d: Drafts) -> Scores:
    """One target forward over `[pending, x_1..x_N]` (N+1 positions per row) and its p."""
    last = b.column([[row.seq[-1]] for row in b.rows])  # [R, 1]
    starts = b.column([row.tlen for row in b.rows])  # [R]
    inputs = torch.cat([last, d.tokens], dim=1)  # [R, N+1]
    hidden = models.target(inputs, b.slots, starts, models.target_cache, b.contiguous)  # [R, N+1, Ht]
    return scores_of(models, b, d, hidden)


def scores_of(models: Models, b: RoundBatch, d: Drafts, hidden: torch.Tensor) -> Scores:
    """p `[R, N+1, V]` from the target's states, each constrained row's positions masked."""
    logits = models.target.logits(hidden)  # [R, N+1, V]
    if d.constrained:
        logits = grammar.mask_logits(logits, d.constrained, torch.stack(d.masks, 1))  # masks [R', N+1, V]
    return Scores(b.probs(logits), hidden)


def _learned_weights(models: Models, b: RoundBatch, h_draft, h_target, p, q, static) -> torch.Tensor:
    """`static` `[R, T]` with the learned rows' entries replaced by the head's w_t, from the states
    `[R, T, Hd]`, `[R, T, Ht]` (for heads that read them) and p, q `[R, T, V]` at those positions
    (for heads that read their statistics). A batch of learned rows only, the usual case, skips the
    gather and scatter: on the embedded pair the head's path is per-op overhead."""
    learned = [i for i, row in enumerate(b.rows) if row.mode.uses_head]
    if not learned:
        return static
    idx = None if len(learned) == b.size else b.column(learned)  # [R'] or every row

    def pick(x: torch.Tensor) -> torch.Tensor:
        return x if idx is None else x[idx]

    dial = b.column([b.rows[i].dial for i in learned], torch.float32)  # [R']
    states = [pick(h_draft).float(), pick(h_target).float()] if wants_states(models.head) else [None, None]
    inputs = [*states, dial]  # [R', T, Hd], [R', T, Ht] (or None), [R']
    if wants_stats(models.head):  # p and q at these positions, after the sampling transform
        inputs.append(position_stats(pick(p), pick(q)))  # [R', T, 5]
    w_head = models.head(*inputs).to(static.dtype).clamp(0.0, 1.0)  # [R', T]
    if idx is None:
        return w_head
    weights = static.clone()
    weights[idx] = w_head
    return weights


def ensemble_weights(models: Models, b: RoundBatch, d: Drafts, s: Scores):
    """(w for `verify`, w per row and position as lists for the row stats).

    Static rows pass their w as a float when the group agrees (verify broadcasts it), else `[R]`;
    learned rows get the head's `[R, N]` w_t from their states and dial."""
    r, n = b.size, b.n
    if not any(row.mode.uses_head for row in b.rows) or n == 0:
        return _param(b.rows, "weight", b.device), [[row.weight] * n for row in b.rows]
    static = b.column([row.weight for row in b.rows], torch.float32).view(-1, 1).expand(r, n)  # [R, N]
    weights = _learned_weights(models, b, d.hidden, s.hidden[:, :n], s.probs[:, :n], d.probs, static)
    return weights, weights.tolist()  # [R, N]


def check(b: RoundBatch, d: Drafts, s: Scores, weights) -> Outcome:
    """`verifier.verify` for the whole group (baseline policies only when some row asks), read
    back to the host in one transfer with the TV estimates the draft-length policy learns from."""
    n = b.n
    policy = None
    if any(row.policy.kind != PolicyKind.ENSEMBLE for row in b.rows) and n:
        policy = PolicyBatch.from_policies([row.policy for row in b.rows], device=b.device)
    # Ranges were checked at admission (weights) or hold by construction (drafts ~ q, head output
    # clamped): skip verify's host-synced value checks on this hot path.
    result = verify(
        s.probs, d.probs, d.tokens, weights, policy=policy, greedy=b.greedy, uniforms=b.u_verify,
        validate=False,
    )  # fmt: skip
    parts = [result.num_accepted.unsqueeze(1).float(), result.tokens.float()]  # ids < 2^24: exact
    if n:
        parts += [result.accept_probs.float(), tv_estimates(s.probs[:, :n], d.probs, d.tokens).float()]
    host = torch.cat(parts, dim=1).tolist()  # [R, 1 + (N+1) + 2N]
    out = Outcome([], [], [], [], [])
    for row, line in zip(b.rows, host, strict=True):
        k = int(line[0])
        tested = min(k + 1, n)
        out.num_accepted.append(k)
        out.tokens.append([int(t) for t in line[1 : n + 2]])
        out.accept_probs.append(line[n + 2 : n + 2 + tested])
        out.tv.append([] if row.greedy else line[2 * n + 2 : 2 * n + 2 + tested])
    return out


def bonus(models: Models, b: RoundBatch, d: Drafts, s: Scores, out: Outcome) -> None:
    """Rows that draw from ν where no draft proposed (`RowMode.draws_nu`) and accepted all N drafts
    (every such row at N = 0) redraw their last token from ν at position N+1 with the same coin:
    one more draft step gives q there (it feeds x_N, or at N = 0 the pending tokens). Other rows
    keep their p draw (ν itself where w = 1)."""
    n = b.n
    idx = [i for i, row in enumerate(b.rows) if row.mode.draws_nu and out.num_accepted[i] == n]
    out.bonus_rows = idx
    if not idx:
        return
    sub = b.subset(idx)
    if n == 0:
        h = _feed_pending(models, sub)  # [R', Hd]
    else:
        at = sub.column(idx)
        x_last = d.tokens[at, n - 1 :]  # [R', 1]
        starts = sub.column([len(row.seq) + n - 1 for row in sub.rows])  # [R']
        h = models.draft(x_last, sub.slots, starts, models.draft_cache, sub.contiguous)[:, 0]  # [R', Hd]
    logits = models.draft.logits(h)  # [R', V]
    held = [(j, d.constrained.index(i)) for j, i in enumerate(idx) if i in d.constrained]
    if held:  # q after the last draft, masked as p_N is
        logits = grammar.mask_logits(logits, [j for j, _ in held], d.masks[n][[c for _, c in held]])
    q = sub.probs(logits)  # [R', V]
    rows = sub.column(idx)
    p = s.probs[rows, n : n + 1]  # [R', 1, V]
    static = sub.column([row.weight for row in sub.rows], torch.float32).view(-1, 1)  # [R', 1]
    w = _learned_weights(models, sub, h.unsqueeze(1), s.hidden[rows, n : n + 1], p, q.unsqueeze(1), static)
    vocab = q.shape[-1]
    result = verify(
        p, q.new_zeros(len(idx), 0, vocab), d.tokens.new_zeros(len(idx), 0), w, bonus_probs=q,
        greedy=sub.greedy, uniforms=sub.u_verify[:, n : n + 1], validate=False,
    )  # fmt: skip
    for i, token in zip(idx, result.tokens[:, 0].tolist(), strict=True):
        out.tokens[i][n] = token
    out.bonus_weights = w[:, 0].tolist()
    for j in logprobs.wanting(sub.rows):  # the ν each drew from, for its log-probs
        out.bonus_laws[idx[j]] = ensemble_mix(p[j, 0], q[j], w[j, 0])


def attach_logprobs(b: RoundBatch, d: Drafts, s: Scores, out: Outcome, weights: list) -> None:
    """The log-probs of each emitted token's law, for the rows that asked (`logprobs.py`)."""
    if logprobs.wanting(b.rows):
        laws = logprobs.speculative_laws(b, d, s, out, weights)
        tokens = {i: out.tokens[i][: out.num_accepted[i] + 1] for i in laws}
        out.logprobs = logprobs.gather(b.rows, laws, tokens)


def advance(b: RoundBatch, out: Outcome, weights: list) -> None:
    """Each row appends its own k + 1 tokens. The target cache keeps pending + k accepted drafts;
    the draft cache keeps the accepted drafts it consumed: min(k, N − 1), or N after a bonus step
    (which fed x_N; at N = 0 it fed the pending tokens)."""
    fed = dict(zip(out.bonus_rows, out.bonus_weights, strict=True))  # row -> its bonus w
    for i, (row, k, toks, w) in enumerate(zip(b.rows, out.num_accepted, out.tokens, weights, strict=True)):
        old_len = len(row.seq)
        row.record_round(k, [*w, fed[i]] if i in fed else w, b.n, bonus_from_nu=i in fed)
        # The row's own acceptance evidence, here rather than in the planner's `learn` (after the
        # round): a row that advanced has learned from its round even if a later row raises.
        row.estimate.observe(out.accept_probs[i])
        row.tlen = old_len + k
        if row.grammar is not None:  # its matcher keeps the k accepted drafts and the final token
            row.grammar.settle(k, toks[k])
        if i in fed:
            row.dlen = old_len + b.n
        elif b.n:
            row.dlen = old_len + min(k, b.n - 1)
        row.emit_tokens(toks[: k + 1], out.logprobs.get(i))


@torch.inference_mode()
def run_round(models: Models, rows: list[Row], n: int, timers: StepTimers) -> float:
    """One round for `rows` (all with num_draft == n); emits each row's accepted tokens and
    returns the round's seconds."""
    dev = models.device
    last = timers.last = {}  # this round's stages (a reset from another thread cannot race it)
    drafted = n > 0
    with timers.phase(Stage.ROUND, dev, drafted=drafted):
        batch = RoundBatch.of(rows, n, dev)
        with timers.phase(Stage.DRAFT, dev, count=n):
            drafts = draft(models, batch)
        with timers.phase(Stage.SCORE, dev, drafted=drafted):
            scores = score(models, batch, drafts)
        with timers.phase(Stage.CHECK, dev, drafted=drafted):
            weights, per_position = ensemble_weights(models, batch, drafts, scores)
            out = check(batch, drafts, scores, weights)
            if models.forced_tv is not None:
                forced.force_acceptance(batch, drafts, scores, out, per_position, models.forced_tv)
        if any(row.mode.draws_nu for row in rows):
            with timers.phase(Stage.BONUS, dev, count=0):
                bonus(models, batch, drafts, scores, out)
            timers.counts[Stage.BONUS] += bool(out.bonus_rows)
        attach_logprobs(batch, drafts, scores, out, per_position)
        advance(batch, out, per_position)
    timers.draft_tokens += n * len(rows)
    timers.row_rounds += len(rows)
    if models.planner is not None:
        models.planner.learn(batch, out, last)
    return last[Stage.ROUND]
