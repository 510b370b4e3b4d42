"""One batched decoding round for rows that share a draft length N, as six small stages:

    batch  = RoundBatch.of(rows, n)          per-row tensors: slots, sampling params, greedy, coins
    drafts = draft(models, batch)            N draft forwards: x [R, N], q [R, N, V], h_draft [R, N, Hd]
    scores = score(models, batch, drafts)    ONE target forward over [pending, x_1..x_N]:
                                             p [R, N+1, V], h_target [R, N+1, Ht]
    w      = ensemble_weights(...)           static w per row, or the learned head's w_t [R, N]
    result = check(batch, drafts, scores, w) one `verifier.verify` call for the whole group
    fed    = bonus(...)                      rows with ν ≠ p that accepted all N: one more draft
                                             step gives q at N+1; the bonus is redrawn from ν
    advance(batch, result, w, fed)           each row appends its k + 1 tokens; caches roll back
                                             by length (stale entries are masked, then overwritten)

Autoregressive rows are the N = 0 case of the same path: no draft forwards, a 1-position target
forward, and `verify` with N = 0 draws the token from p with the row's first verify coin.
The draft length is decided before a round (the scheduler groups rows by N): that is where
cost-aware draft lengths plug in; a round only ever sees one N.

Terms
    pending   the tokens a cache has not consumed yet: 1 for the target (the last token), 1 or 2
              for the draft (2 when every draft of the last round was accepted without a bonus
              step, see row.py).
    h_draft   `[R, N, Hd]` final-norm draft states at the positions that produced each draft token.
    h_target  `[R, N+1, Ht]` final-norm target states at the positions scoring each draft token.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from server.engine.kv_cache import KVCache
from server.engine.llama import Transformer
from server.engine.row import Row
from verifier import PolicyBatch, PolicyKind, VerifyResult, logits_to_probs, pick_tokens, verify
from verifier.head import position_stats, wants_stats

WeightHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# phase name -> the counter it bumps (besides `<phase>_s`)
_COUNTERS = {
    "draft": "draft_forwards",
    "verify_forward": "verify_forwards",
    "target_forward": "target_forwards",
    "round": "rounds",
}


@dataclass
class StepTimers:
    """Wall-clock seconds per phase (summed over rounds) — the benchmark's cost-model inputs."""

    draft_s: float = 0.0  # N draft forwards with their sampling
    draft_forwards: int = 0
    verify_forward_s: float = 0.0  # target forwards over N+1 positions (N >= 1), with p
    verify_forwards: int = 0
    target_forward_s: float = 0.0  # target forwards over 1 position (autoregressive rows), with p
    target_forwards: int = 0
    verify_call_s: float = 0.0  # weights (head), verifier.verify, reading the results back
    round_s: float = 0.0
    rounds: int = 0
    per_n: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.__init__()

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device, count: int = 1):
        """Time a phase; on CUDA the device is synchronised first so kernels count where they run."""
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        setattr(self, f"{name}_s", getattr(self, f"{name}_s") + time.perf_counter() - t0)
        if name in _COUNTERS:
            setattr(self, _COUNTERS[name], getattr(self, _COUNTERS[name]) + count)


@dataclass
class Models:
    target: Transformer
    draft: Transformer
    target_cache: KVCache
    draft_cache: KVCache
    device: torch.device
    head: WeightHead | None = None
    num_threads: int | None = None  # intra-op threads for the thread running the model math


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
    n: int  # draft length, 0 = autoregressive
    device: torch.device
    slots: torch.Tensor  # [R] cache slots
    contiguous: bool  # slots == arange(R): cache reads are views
    greedy: bool | torch.Tensor  # True/False when the group agrees, else a [R] mask
    temperature: float | torch.Tensor  # scalar or [R]
    top_k: int | torch.Tensor
    top_p: float | torch.Tensor
    u_draft: torch.Tensor  # [R, N] the rows' coins for sampling drafts
    u_verify: torch.Tensor  # [R, N+1] their coins for the acceptance tests and the final draw

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


@dataclass
class Scores:
    probs: torch.Tensor  # [R, N+1, V] p
    hidden: torch.Tensor  # [R, N+1, Ht]


def draft(models: Models, b: RoundBatch) -> Drafts:
    """N batched draft forwards. The first feeds each row's pending tokens (1 or 2, right-padded
    to the longest; each row reads its state at its own last real position); the rest feed one."""
    r, n = b.size, b.n
    vocab = models.draft.args.vocab_size
    if n == 0:
        empty = torch.zeros(r, 0, dtype=torch.long, device=b.device)  # [R, 0]
        return Drafts(empty, torch.zeros(r, 0, vocab, device=b.device), None)
    pending = [row.seq[row.dlen :] for row in b.rows]
    width = max(len(p) for p in pending)
    tokens = b.column([p + [p[-1]] * (width - len(p)) for p in pending])  # [R, T0]
    starts = b.column([row.dlen for row in b.rows])  # [R]
    hidden = models.draft(tokens, b.slots, starts, models.draft_cache, b.contiguous)  # [R, T0, Hd]
    h = hidden[torch.arange(r, device=b.device), b.column([len(p) - 1 for p in pending])]  # [R, Hd]
    base = b.column([len(row.seq) for row in b.rows])  # [R] position of draft token 1
    xs, qs, hs = [], [], []
    for i in range(n):
        q = b.probs(models.draft.logits(h))  # [R, V]
        x = pick_tokens(q, b.greedy, b.u_draft[:, i])  # [R]
        xs.append(x)
        qs.append(q)
        hs.append(h)
        if i < n - 1:  # the last proposal is never fed: its state would be rolled back or unused
            h = models.draft(x.view(-1, 1), b.slots, base + i, models.draft_cache, b.contiguous)[:, 0]
    return Drafts(torch.stack(xs, 1), torch.stack(qs, 1), torch.stack(hs, 1))


def score(models: Models, b: RoundBatch, d: Drafts) -> Scores:
    """One target forward over `[pending, x_1..x_N]` (N+1 positions per row) and its p."""
    last = b.column([[row.seq[-1]] for row in b.rows])  # [R, 1]
    starts = b.column([row.tlen for row in b.rows])  # [R]
    inputs = torch.cat([last, d.tokens], dim=1)  # [R, N+1]
    hidden = models.target(inputs, b.slots, starts, models.target_cache, b.contiguous)  # [R, N+1, Ht]
    return Scores(b.probs(models.target.logits(hidden)), hidden)


def ensemble_weights(models: Models, b: RoundBatch, d: Drafts, s: Scores):
    """(w for `verify`, w per row and position as lists for the row stats).

    Static rows pass their w as a float when the group agrees (verify broadcasts it), else `[R]`;
    learned rows get the head's `[R, N]` w_t from their states and dial."""
    r, n = b.size, b.n
    if not any(row.learned for row in b.rows) or n == 0:
        return _param(b.rows, "weight", b.device), [[row.weight] * n for row in b.rows]
    static = b.column([row.weight for row in b.rows], torch.float32).view(-1, 1).expand(r, n)  # [R, N]
    weights = _learned_weights(models, b, d.hidden, s.hidden[:, :n], s.probs[:, :n], d.probs, static)
    return weights, weights.tolist()  # [R, N]


def _learned_weights(models: Models, b: RoundBatch, h_draft, h_target, p, q, static) -> torch.Tensor:
    """`static` `[R, T]` with the learned rows' entries replaced by the head's w_t, from the states
    `[R, T, Hd]`, `[R, T, Ht]` and (for heads that read them) p, q `[R, T, V]` at those positions."""
    learned = [i for i, row in enumerate(b.rows) if row.learned]
    weights = static.clone()
    if not learned:
        return weights
    idx = b.column(learned)
    dial = b.column([b.rows[i].dial for i in learned], torch.float32)  # [R']
    inputs = [h_draft[idx].float(), h_target[idx].float(), dial]  # [R', T, Hd], [R', T, Ht], [R']
    if wants_stats(models.head):  # p and q at these positions, after the sampling transform
        inputs.append(position_stats(p[idx], q[idx]))  # [R', T, 5]
    w_head = models.head(*inputs)  # [R', T]
    weights[idx] = w_head.to(weights.dtype).clamp(0.0, 1.0)
    return weights


def _needs_q(row: Row) -> bool:
    """The row's bonus follows ν ≠ p: an ensemble row with a static w < 1 or a learned w_t."""
    return row.policy.kind == PolicyKind.ENSEMBLE and (row.learned or row.weight < 1.0)


def bonus(models: Models, b: RoundBatch, d: Drafts, s: Scores, num_accepted: list[int], tokens, per_position):
    """Rows whose N drafts were all accepted and whose ν ≠ p redraw their bonus (token N+1) from ν,
    with the same coin `verify` used for the p draw: one more draft step (feeding x_N) gives q there.
    Without it the bonus would follow p, and quality 0 would not be pure draft output. w = 1 rows
    keep the p draw (ν = p, bit-identical). Edits `tokens` and appends the bonus w to
    `per_position` for the rows it redraws, and returns them (their draft cache now holds x_N)."""
    n = b.n
    redraw = [i for i, row in enumerate(b.rows) if n and num_accepted[i] == n and _needs_q(row)]
    if not redraw:
        return []
    # The whole group steps (one batched forward); rows not redrawn ignore the result, and the
    # KV they wrote past their kept length is overwritten before it is ever read.
    x_last = d.tokens[:, n - 1 :]  # [R, 1]
    starts = b.column([len(row.seq) + n - 1 for row in b.rows])  # [R] position of x_N
    h = models.draft(x_last, b.slots, starts, models.draft_cache, b.contiguous)  # [R, 1, Hd]
    q = b.probs(models.draft.logits(h[:, 0]))  # [R, V]
    static = b.column([row.weight for row in b.rows], torch.float32).view(-1, 1)  # [R, 1]
    p = s.probs[:, n : n + 1]  # [R, 1, V]
    w = _learned_weights(models, b, h, s.hidden[:, n : n + 1], p, q.unsqueeze(1), static)  # [R, 1]
    r, vocab = q.shape
    result = verify(
        p, q.new_zeros(r, 0, vocab), d.tokens.new_zeros(r, 0), w, bonus_probs=q, greedy=b.greedy,
        uniforms=b.u_verify[:, n : n + 1], validate=False,
    )  # fmt: skip
    drawn, w_list = result.tokens[:, 0].tolist(), w[:, 0].tolist()
    for i in redraw:
        tokens[i][n] = drawn[i]
        per_position[i] = [*per_position[i], w_list[i]]
    return redraw


def check(b: RoundBatch, d: Drafts, s: Scores, weights) -> VerifyResult:
    """`verifier.verify` for the whole group (baseline policies only when some row asks)."""
    policy = None
    if any(row.policy.kind != PolicyKind.ENSEMBLE for row in b.rows) and b.n:
        policy = PolicyBatch.from_policies([row.policy for row in b.rows], device=b.device)
    # Ranges were checked at admission (weights) or hold by construction (drafts ~ q, head output
    # clamped): skip verify's host-synced value checks on this hot path.
    return verify(
        s.probs, d.probs, d.tokens, weights, policy=policy, greedy=b.greedy, uniforms=b.u_verify,
        validate=False,
    )  # fmt: skip


def advance(
    b: RoundBatch, num_accepted: list[int], tokens: list[list[int]], weights: list, fed: list[int]
) -> None:
    """Each row appends its own k + 1 tokens. The target cache keeps pending + k accepted drafts;
    the draft cache keeps min(k, N − 1) of them (it never consumed its last proposal), or N for
    the rows in `fed`, whose bonus step consumed x_N."""
    for i, (row, k, toks, w) in enumerate(zip(b.rows, num_accepted, tokens, weights, strict=True)):
        old_len = len(row.seq)
        row.record_round(k, w)
        row.tlen = old_len + k
        if b.n:
            row.dlen = old_len + (b.n if i in fed else min(k, b.n - 1))
        row.emit_tokens(toks[: k + 1])


@torch.inference_mode()
def run_round(models: Models, rows: list[Row], n: int, timers: StepTimers) -> None:
    """One round for `rows` (all with num_draft == n); emits each row's accepted tokens."""
    dev = models.device
    with timers.phase("round", dev):
        batch = RoundBatch.of(rows, n, dev)
        with timers.phase("draft", dev, count=n):
            drafts = draft(models, batch)
        with timers.phase("verify_forward" if n else "target_forward", dev):
            scores = score(models, batch, drafts)
        with timers.phase("verify_call", dev):
            weights, per_position = ensemble_weights(models, batch, drafts, scores)
            result = check(batch, drafts, scores, weights)
            num_accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
            fed = bonus(models, batch, drafts, scores, num_accepted, tokens, per_position)
        advance(batch, num_accepted, tokens, per_position, fed)


_PREFILL_TOKEN_BUDGET = 8192  # padded prompt tokens per prefill forward (bounds the [R, P, P] mask)


@torch.inference_mode()
def prefill(models: Models, rows: list[Row]) -> None:
    """Fill the caches with each row's `prompt[:-1]` (the last prompt token is the first round's
    pending input). Rows admitted together share one right-padded forward per model: padding
    lands past each row's length, where it is masked out and later overwritten."""
    dev = models.device
    todo = [row for row in rows if len(row.seq) > 1]
    for row in rows:
        row.tlen = row.dlen = len(row.seq) - 1
    todo.sort(key=lambda row: len(row.seq))
    while todo:
        group = [todo.pop()]  # longest first; add rows while the padded batch fits the budget
        while todo and (len(group) + 1) * (len(group[0].seq) - 1) <= _PREFILL_TOKEN_BUDGET:
            group.append(todo.pop())
        width = len(group[0].seq) - 1
        padded = [row.seq[:-1] + [0] * (width - len(row.seq) + 1) for row in group]
        tokens = torch.tensor(padded, dtype=torch.long, device=dev)  # [R, P]
        slots = torch.tensor([row.slot for row in group], device=dev)  # [R]
        starts = torch.zeros(len(group), dtype=torch.long, device=dev)  # [R]
        models.target(tokens, slots, starts, models.target_cache)
        spec = [i for i, row in enumerate(group) if row.num_draft]
        if spec:
            idx = torch.tensor(spec, device=dev)
            models.draft(tokens[idx], slots[idx], starts[idx], models.draft_cache)
