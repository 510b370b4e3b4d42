"""ν is built from what SGLang samples: the target after its grammar mask, penalties, logit_bias
and min_new_tokens, with the same vocabulary mask applied to the draft's q before mixing.

Everything runs through SGLang 0.5.23's real `eagle_sample` (tests/sglang_eagle_cpu.py): its
`SamplingBatchInfo`, its penalizer orchestrator with `BatchedMinNewTokensPenalizer` (−inf on stop
tokens), its `logit_bias` add, its `GrammarMask` applied with SGLang's Triton bitmask op. The draft
proposes forbidden tokens on purpose (most of q's mass sits on them), so an unmasked ν would accept
them at w < 1 — the power check shows this test would see it.

1. No forbidden token is ever emitted (accepted draft, correction or bonus) at any w, w = 0
   included, for sampled and greedy rows, through SGLang's real chain kernel (Triton, interpreted).
2. The law: over 20 000 identical rows (pure-torch reference kernel, token-for-token equal to the
   Triton one: tests/test_sglang_chain_kernel.py), the token emitted at each draft position
   follows the masked ν̃ = w·p̃ + (1−w)·q̃ computed independently here; an accepted draft follows
   min(q, ν̃)/Σ min(q, ν̃) and the acceptance rate is Σ min(q, ν̃). Chi-square / binomial tests at
   α = 1e-4 each (tests/stats.py: a correct implementation trips one with probability < 1e-3 over
   the file); the same test rejects the unmasked ν.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from server.sglang_plugin import ensemble, verify_hooks
from server.sglang_plugin.ensemble import chain_rejection_reference
from server.sglang_plugin.params import PluginSettings
from tests import sglang_eagle_cpu as sgl_eagle
from tests.sglang_kernel import load_chain_kernel
from tests.stats import ALPHA, Z_BOUND, binomial_z, chi_square_pvalue

N, V = 3, 16
STOP, BIASED = 2, 5  # min_new_tokens bans the stop token; logit_bias -100 bans BIASED
SETTINGS = PluginSettings(enabled=True, default_w=1.0)


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    monkeypatch.setattr(verify_hooks, "_original_logprobs_requested", lambda: False)


def _grammar_allowed(b: int, seed: int) -> torch.Tensor:
    """`[B·(N+1), V]` allowed tokens per verify slot: a third of the vocabulary banned per slot."""
    g = torch.Generator().manual_seed(seed)
    banned = torch.rand(b * (N + 1), V, generator=g) < 1 / 3
    return ~banned


def _req(i: int, w: float, greedy: bool) -> sgl_eagle.Req:
    return sgl_eagle.Req(
        f"r{i}", V, temperature=0.0 if greedy else 0.9, custom_params={"dialspec_w": w},
        min_new_tokens=4, stop_token_ids=[STOP], logit_bias={str(BIASED): -100.0},
    )  # fmt: skip


def _step(reqs, logits, q, cand, allowed, kernel, monkeypatch, seed=0, fast_grammar=False):
    """One verify step through the hooks and SGLang's eagle_sample; returns emitted tokens."""
    sgl_eagle.stand_in_platform(monkeypatch, lambda **kw: verify_hooks.chain_kernel_around(kernel, **kw))
    batch = sgl_eagle.Batch(reqs, V)
    hook = verify_hooks.make_eagle_sample_hook(SETTINGS)
    out = SimpleNamespace(next_token_logits=logits.clone())
    torch.manual_seed(seed)
    result = hook(
        sgl_eagle.modules().eagle_utils.eagle_sample, sgl_eagle.verify_input(cand, q), batch, out,
        sgl_eagle.grammar_mask(allowed, fast=fast_grammar),
    )  # fmt: skip
    return sgl_eagle.emitted(*result)


def _forbidden_drafts(b: int, allowed: torch.Tensor, seed: int):
    """Target logits, and a q with most mass on each slot's forbidden tokens; drafts x ~ q."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b * (N + 1), V, generator=g)
    bad = ~allowed.view(b, N + 1, V)[:, :N]  # [B, N, V] forbidden at the slot that scores x
    bad[..., STOP] = bad[..., BIASED] = True
    q = torch.softmax(torch.randn(b, N, V, generator=g) + 4.0 * bad, -1)  # ≈ 90 % on forbidden
    x = torch.multinomial(q.view(-1, V), 1, generator=g).view(b, N)
    return logits, q, torch.cat([torch.zeros(b, 1, dtype=torch.long), x], 1), bad


def _violations(tokens, allowed, b):
    allowed = allowed.view(b, N + 1, V).clone()
    allowed[..., STOP] = allowed[..., BIASED] = False
    return [(r, j, t) for r in range(b) for j, t in enumerate(tokens[r]) if not bool(allowed[r, j, t])]


@pytest.fixture(scope="module")
def triton_kernel():
    return load_chain_kernel(interpret=True).chain_speculative_sampling_triton


ROWS = [(w, greedy) for w in (0.0, 0.3, 0.7, 1.0) for greedy in (False, True)] * 3  # 24 rows


def test_no_forbidden_token_is_emitted_at_any_w(triton_kernel, monkeypatch):
    b = len(ROWS)
    allowed = _grammar_allowed(b, seed=1)
    logits, q, cand, _ = _forbidden_drafts(b, allowed, seed=2)
    reqs = [_req(i, w, greedy) for i, (w, greedy) in enumerate(ROWS)]
    tokens = _step(reqs, logits, q, cand, allowed, triton_kernel, monkeypatch)
    assert _violations(tokens, allowed, b) == []
    # Power: with q left unmasked (the mask switched off in the plugin), forbidden tokens get in.
    monkeypatch.setattr(ensemble, "_banned", lambda logits, bias: torch.zeros_like(logits, dtype=torch.bool))
    tokens = _step(
        [_req(i, w, g) for i, (w, g) in enumerate(ROWS)], logits, q, cand, allowed, triton_kernel, monkeypatch
    )
    assert len(_violations(tokens, allowed, b)) > 5


def reference_kernel(
    *, predicts, accept_index, accept_token_num, candidates, retrive_index, uniform_samples,
    uniform_samples_for_final_sampling, target_probs, draft_probs, **_,
):  # fmt: skip
    """`chain_rejection_reference` writing the kernel's outputs (tests/test_sglang_chain_kernel.py
    shows it emits the Triton kernel's tokens for the same coins)."""
    n = candidates.shape[1] - 1
    acc, toks = chain_rejection_reference(
        candidates.long(),
        target_probs,
        draft_probs,
        uniform_samples[:, :n],
        uniform_samples_for_final_sampling,
    )
    kept = torch.arange(n + 1) <= acc.unsqueeze(1)  # [B, N+1]
    predicts[retrive_index[kept]] = toks[kept].to(predicts.dtype)
    accept_index[kept] = retrive_index[kept].to(accept_index.dtype)
    accept_token_num.copy_(acc)


def masked_nu(logits_row, q_row, allowed_row, w, temperature):
    """Independent restatement (DESIGN.md, Constraints): `[N, V]` ν̃ for one row."""
    allowed = allowed_row[:N].clone()
    allowed[:, STOP] = allowed[:, BIASED] = False
    z = logits_row[:N].double()
    z[:, BIASED] -= 100.0  # what SGLang adds before softmax; then banned for q too
    p = torch.where(allowed, torch.softmax(z / temperature, -1), 0.0)
    qm = torch.where(allowed, q_row.double(), 0.0)
    return w * p / p.sum(-1, keepdim=True) + (1 - w) * qm / qm.sum(-1, keepdim=True)


ROWS_LAW = 20_000


@pytest.mark.slow
@pytest.mark.parametrize("w", [0.0, 0.4])
def test_emitted_and_accepted_tokens_follow_the_masked_nu(w, monkeypatch):
    g = torch.Generator().manual_seed(7)
    one_allowed = _grammar_allowed(1, seed=8)  # [N+1, V]
    logits1, q1, _, _ = _forbidden_drafts(1, one_allowed, seed=9)
    allowed = one_allowed.repeat(ROWS_LAW, 1)
    logits = logits1.repeat(ROWS_LAW, 1)
    q = q1.expand(ROWS_LAW, N, V).contiguous()
    x = torch.multinomial(q1[0].repeat(ROWS_LAW, 1), 1, generator=g).view(ROWS_LAW, N)  # x_j ~ q_j
    cand = torch.cat([torch.zeros(ROWS_LAW, 1, dtype=torch.long), x], 1)
    reqs = [_req(i, w, greedy=False) for i in range(ROWS_LAW)]
    tokens = _step(reqs, logits, q, cand, allowed, reference_kernel, monkeypatch, seed=10, fast_grammar=True)
    nu = masked_nu(logits1, q1[0], one_allowed, w, 0.9)  # [N, V]
    first = torch.tensor([t[0] for t in tokens])
    assert chi_square_pvalue(first, nu[0]) > ALPHA, "position 0 does not follow ν̃"
    for j in (1, 2):
        reached = torch.tensor([t[j] for t in tokens if len(t) > j])  # drafts 0..j-1 accepted
        assert chi_square_pvalue(reached, nu[j]) > ALPHA, f"position {j} does not follow ν̃"
    overlap = torch.minimum(q1[0, 0].double(), nu[0])  # [V] law of an accepted draft, unnormalised
    n_acc = torch.tensor([len(t) > 1 for t in tokens]).sum()
    assert abs(binomial_z(float(n_acc), ROWS_LAW, float(overlap.sum()))) < Z_BOUND
    accepted = torch.tensor([t[0] for t in tokens if len(t) > 1])
    assert chi_square_pvalue(accepted, overlap) > ALPHA, "accepted drafts do not follow min(q, ν̃)"
    unmasked = w * torch.softmax(logits1[0].double() / 0.9, -1) + (1 - w) * q1[0, 0].double()
    assert chi_square_pvalue(first, unmasked) < 1e-12  # power: the unmasked ν is rejected
