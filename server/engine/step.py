"""One batched decoding round for a group of rows sharing a draft length N.

Round for R speculative rows (N >= 1):
    1. Draft: N batched draft forwards. The first feeds each row's pending tokens (1 or 2,
       right-padded to the longest; each row reads its logits at its own last real position);
       forwards 2..N feed one token per row. Draft token i comes from `q_i` =
       `logits_to_probs(draft logits)`: argmax for greedy rows, `sample_inverse_cdf` with the
       row's own uniform otherwise.
    2. Verify: ONE target forward over `[pending, x_1..x_N]` (N+1 positions per row) gives
       `p` `[R, N+1, V]` through the same transform, then one `verifier.verify` call for the batch
       with per-row weights (or head-predicted `[R, N]` weights), policies, greedy flags and
       uniforms.
    3. Advance: each row appends its own `k + 1` tokens; the target cache keeps `k` accepted
       drafts, the draft cache keeps `min(k, N - 1)` of them. Rejected positions are rolled back
       simply by the lengths (stale entries are masked and later overwritten).
Autoregressive rows are the N = 0 case of the same round: no draft, a 1-position target forward,
and the token is drawn from p with the row's first verify uniform, exactly what `verify` does with
N = 0 (seeding and transforms are shared), without its per-call input checks.

Terms: h_draft `[R, N, Hd]` final-norm draft states at the positions that produced each draft
token; h_target `[R, N, Ht]` target states at the positions scoring each draft token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from server.engine.kv_cache import KVCache
from server.engine.llama import Transformer
from server.engine.row import Row
from verifier import PolicyBatch, PolicyKind, logits_to_probs, sample_inverse_cdf, verify

WeightHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepTimers:
    """Wall-clock seconds spent per phase (summed over rounds) — the benchmark's cost model inputs."""

    draft_s: float = 0.0
    draft_forwards: int = 0
    verify_forward_s: float = 0.0  # target forwards over N+1 positions (N >= 1)
    verify_forwards: int = 0
    target_forward_s: float = 0.0  # target forwards over 1 position (autoregressive rows)
    target_forwards: int = 0
    verify_call_s: float = 0.0  # verification: building w/policies, verifier.verify, reading results
    round_s: float = 0.0
    rounds: int = 0
    per_n: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.__init__()


@dataclass
class Models:
    target: Transformer
    draft: Transformer
    target_cache: KVCache
    draft_cache: KVCache
    device: torch.device
    head: WeightHead | None = None
    num_threads: int | None = None  # intra-op threads for the thread running the model math


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _col(rows: list[Row], name: str, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(r, name) for r in rows], dtype=dtype, device=device)  # [R]


def _probs(logits: torch.Tensor, temp, top_k, top_p) -> torch.Tensor:
    """`verifier.logits_to_probs`, short-circuited when the whole group uses the identity transform
    (temperature 1, no top-k/top-p — also every greedy group): then it is exactly a float32
    softmax, and skipping its per-call checks saves a dozen tiny ops per draft step."""
    if isinstance(temp, float) and temp == 1.0 and top_k == 0 and top_p == 1.0:
        return logits.float().softmax(dim=-1)
    return logits_to_probs(logits, temp, top_k, top_p)


def _pick(probs: torch.Tensor, greedy: torch.Tensor, all_greedy: bool | None, u: torch.Tensor):
    """argmax for greedy rows, inverse-CDF sample with the row's uniform `u` `[R]` otherwise."""
    if all_greedy is True:
        return probs.argmax(-1)
    if all_greedy is False:
        return sample_inverse_cdf(probs, u)
    return torch.where(greedy, probs.argmax(-1), sample_inverse_cdf(probs, u))


def _param(rows: list[Row], name: str, device, dtype=torch.float32):
    """A sampling parameter for `logits_to_probs`: a Python scalar when every row agrees (the
    transform then skips per-row broadcasting, and top-k/top-p skip their sorts when off), else
    a `[R]` tensor."""
    values = [getattr(r, name) for r in rows]
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=device)  # [R]


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


@torch.inference_mode()
def run_round(models: Models, rows: list[Row], n: int, timers: StepTimers) -> None:
    """One round for `rows` (all with num_draft == n); emits each row's accepted tokens."""
    dev = models.device
    r = len(rows)
    t0 = time.perf_counter()
    slots = torch.tensor([row.slot for row in rows], device=dev)  # [R]
    greedy = _col(rows, "greedy", dev, torch.bool)  # [R]
    flags = {row.greedy for row in rows}
    all_greedy = flags.pop() if len(flags) == 1 else None  # True / False when uniform
    temp = _param(rows, "temperature", dev)
    top_k, top_p = _param(rows, "top_k", dev, torch.long), _param(rows, "top_p", dev)
    contiguous = [row.slot for row in rows] == list(range(r))
    coins = torch.stack([row.uniforms(2 * n + 1) for row in rows]).to(dev)  # [R, 2N+1]
    u_draft, u_verify = coins[:, :n], coins[:, n:]  # [R, N], [R, N+1]

    # 1. Draft N tokens per row.
    draft_tokens, draft_probs, h_draft = [], [], []
    if n:
        pending = [row.seq[row.dlen :] for row in rows]
        width = max(len(p) for p in pending)
        padded = [p + [p[-1]] * (width - len(p)) for p in pending]
        tokens = torch.tensor(padded, dtype=torch.long, device=dev)  # [R, T0]
        starts = torch.tensor([row.dlen for row in rows], dtype=torch.long, device=dev)  # [R]
        hidden = models.draft(tokens, slots, starts, models.draft_cache, contiguous)  # [R, T0, Hd]
        last = torch.tensor([len(p) - 1 for p in pending], device=dev)  # [R]
        h = hidden[torch.arange(r, device=dev), last]  # [R, Hd]
        base = torch.tensor([len(row.seq) for row in rows], dtype=torch.long, device=dev)  # [R]
        for i in range(n):
            q = _probs(models.draft.logits(h), temp, top_k, top_p)  # [R, V]
            x = _pick(q, greedy, all_greedy, u_draft[:, i])  # [R]
            draft_tokens.append(x)
            draft_probs.append(q)
            h_draft.append(h)
            if i < n - 1:  # the last proposal is never fed: its state would be rolled back or unused
                h = models.draft(x.view(-1, 1), slots, base + i, models.draft_cache, contiguous)[:, 0]
        timers.draft_forwards += n
    _sync(dev)
    t1 = time.perf_counter()
    timers.draft_s += t1 - t0

    # 2. One target forward over N+1 positions per row.
    last_tok = torch.tensor([[row.seq[-1]] for row in rows], dtype=torch.long, device=dev)  # [R, 1]
    x_all = torch.stack(draft_tokens, 1) if n else last_tok.new_zeros(r, 0)  # [R, N]
    verify_in = torch.cat([last_tok, x_all], dim=1)  # [R, N+1]
    tstarts = torch.tensor([row.tlen for row in rows], dtype=torch.long, device=dev)  # [R]
    h_target = models.target(verify_in, slots, tstarts, models.target_cache, contiguous)  # [R, N+1, Ht]
    # p goes through the same transform as q; autoregressive decoding needs it too, so it is
    # counted with the target forward, not with verification.
    p = _probs(models.target.logits(h_target), temp, top_k, top_p)  # [R, N+1, V]
    _sync(dev)
    t2 = time.perf_counter()
    if n:
        timers.verify_forward_s += t2 - t1
        timers.verify_forwards += 1
    else:
        timers.target_forward_s += t2 - t1
        timers.target_forwards += 1

    if not n:  # autoregressive rows: sample p directly (what verify does with N = 0, minus checks)
        first = p[:, 0]  # [R, V]
        picks = _pick(first, greedy, all_greedy, u_verify[:, 0])  # [R]
        for row, tok in zip(rows, picks.tolist(), strict=True):
            row.record_round(0, [])
            row.tlen = len(row.seq)
            row.emit_tokens([tok])
        timers.round_s += time.perf_counter() - t0
        timers.rounds += 1
        return

    # 3. Verify the whole group at once.
    q_all = torch.stack(draft_probs, 1)  # [R, N, V]
    learned = [i for i, row in enumerate(rows) if row.learned]
    weights_cpu = [[row.weight] * n for row in rows]  # per-position w, for the stats
    if learned:  # per-token w_t from the head for those rows, the dial value for the others
        weights = _col(rows, "weight", dev).view(-1, 1).expand(r, n).clone()  # [R, N]
        idx = torch.tensor(learned, device=dev)
        hd = torch.stack(h_draft, 1)[idx]  # [R', N, Hd]
        w_head = models.head(hd.float(), h_target[idx, :n].float(), weights[idx, 0])  # [R', N]
        weights[idx] = w_head.to(weights.dtype).clamp(0.0, 1.0)
        weights_cpu = weights.tolist()
    else:  # a float when the group agrees (verify broadcasts it), else one w per row
        weights = _param(rows, "weight", dev)
    policy = None
    if any(row.policy.kind != PolicyKind.ENSEMBLE for row in rows):
        policy = PolicyBatch.from_policies([row.policy for row in rows], device=dev)
    g = greedy if all_greedy is None else all_greedy
    # Range checks were done at submission (weights) or hold by construction (drafts ~ q, head
    # output clamped): skip verify's host-synced value checks on this hot path.
    result = verify(p, q_all, x_all, weights, policy=policy, greedy=g, uniforms=u_verify, validate=False)
    num_accepted = result.num_accepted.tolist()
    out_tokens = result.tokens.tolist()
    _sync(dev)
    t3 = time.perf_counter()
    timers.verify_call_s += t3 - t2

    # 4. Advance each row by its own accepted length.
    for row, k, toks, w in zip(rows, num_accepted, out_tokens, weights_cpu, strict=True):
        old_len = len(row.seq)
        row.record_round(k, w)
        row.tlen = old_len + k  # pending + k accepted drafts are valid target positions
        row.dlen = old_len + min(k, n - 1) if n else row.dlen
        row.emit_tokens(toks[: k + 1])
    t4 = time.perf_counter()
    timers.round_s += t4 - t0
    timers.rounds += 1
