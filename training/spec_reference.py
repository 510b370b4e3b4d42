"""A slow, simple, correct speculative-decoding loop, used to *measure* a pair's acceptance.

No KV cache: every draft step and every verification re-runs the full sequences. Rows (prompts)
are batched with left padding and explicit position ids, so padding never changes a row's math.

Terms
    round       the draft proposes N tokens autoregressively (x_i ~ q_i, sampled at temperature T),
                then one target forward scores all N plus the bonus position and
                `verifier.verify` accepts a prefix and emits one correction/bonus token.
    acceptance  accepted draft tokens / proposed draft tokens over all rounds (the paper's and
                SGLang's `spec_accept_rate`); each active row proposes N per round.
With weight 1 the emitted text is distributed exactly as the target's own sampling (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier import logits_to_probs, verify


@dataclass(frozen=True)
class AcceptanceStats:
    proposed: int
    accepted: int
    rounds: int
    emitted: int

    @property
    def rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    def as_dict(self) -> dict:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "emitted": self.emitted,
            "acceptance": round(self.rate, 4),
        }


def _pad_left(seqs: list[list[int]], pad_id: int):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(s)
        mask[r, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _last_logits(model, seqs, pad_id, k: int) -> torch.Tensor:
    """Logits `[B, k, V]` predicting the token after each of the last k positions of every row."""
    ids, mask, pos = _pad_left(seqs, pad_id)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -k:].float()


@torch.no_grad()
def measure_acceptance(
    target,
    draft,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    num_draft: int = 5,
    temperature: float = 1.0,
    weight: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> AcceptanceStats:
    """Run speculative sampling on every prompt to eos or `max_new_tokens`; count acceptance."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompts]
    made = [0] * len(seqs)
    active = list(range(len(seqs)))
    proposed = accepted = rounds = 0
    while active:
        rows = [seqs[i] for i in active]
        full, qs = [list(r) for r in rows], []
        for _ in range(num_draft):
            q = logits_to_probs(_last_logits(draft, full, pad_id, 1)[:, 0], temperature)  # [B, V]
            picks = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
            for r, t in zip(full, picks, strict=True):
                r.append(t)
            qs.append(q)
        x = torch.tensor([r[-num_draft:] for r in full])  # [B, N]
        q = torch.stack(qs, 1)  # [B, N, V]
        p = logits_to_probs(_last_logits(target, full, pad_id, num_draft + 1), temperature)  # [B, N+1, V]
        res = verify(p, q, x, weight, generator=gen)
        rounds += 1
        still = []
        for b, i in enumerate(active):
            proposed += num_draft
            accepted += int(res.num_accepted[b])
            new = [t for t in res.tokens[b].tolist() if t >= 0]
            if eos_id in new:
                new = new[: new.index(eos_id) + 1]
            new = new[: max_new_tokens - made[i]]
            seqs[i] += new
            made[i] += len(new)
            if made[i] < max_new_tokens and eos_id not in new:
                still.append(i)
        active = still
    return AcceptanceStats(proposed, accepted, rounds, sum(made))
