"""SGLang 0.5.23's own Triton chain kernel, fed ν by the plugin's kernel hook, is the DIVERSED rule.

The kernel (`chain_speculative_sampling_triton`, loaded by path from SGLang's source: see
`tests/sglang_kernel.py`) is called exactly as `eagle_sample` calls it (keyword arguments, chain
retrieve indices), wrapped by `verify_hooks.chain_kernel_around` with the step's weights published,
so the plugin's real ν substitution sits in front of it.

- Everywhere (CPU in CI through Triton's interpreter; CUDA under `scripts/gpu_smoke.sh`): for the
  same coins the kernel emits exactly the tokens of `ensemble.chain_rejection_reference`, the torch
  restatement whose output law `test_sglang_ensemble.py` tests statistically. This ties those
  statistical tests to the real kernel.
- On CUDA only (the interpreter costs ~15 ms per row, far too slow for 10^5 rows): chi-square
  tests on the kernel's own output over 200k rows per case — every emitted position follows ν,
  the bonus follows p_N, accept counts follow 1 − w·TV, a batch mixing w = 0 and w = 1 rows
  gives each group its own law, and the same test rejects p at w = 0.5 (power).
"""

from __future__ import annotations

import pytest
import torch

from server.sglang_plugin import verify_hooks
from server.sglang_plugin.ensemble import chain_rejection_reference, mix_target_probs
from tests.device import DEVICE
from tests.sglang_kernel import load_chain_kernel
from tests.stats import ALPHA, Z_BOUND, binomial_z, chi_square_pvalue

ON_CUDA = DEVICE.type == "cuda"
V, N = 6, 3
# Rows for the kernel-vs-reference comparison: interpreter cost bounds the CPU run.
EQUALITY_ROWS = 20_000 if ON_CUDA else 160
LAW_TRIALS = 200_000
cuda_only = pytest.mark.skipif(
    not ON_CUDA, reason="statistical runs of the real kernel need CUDA (scripts/gpu_smoke.sh)"
)


@pytest.fixture(scope="module")
def kernel():
    return load_chain_kernel(interpret=not ON_CUDA).chain_speculative_sampling_triton


def run_kernel(kernel, cand, target_probs, draft_probs, coins, coins_final, weights):
    """One verify step through the plugin's hook: cand `[B, N+1]` (slot 0 = last committed token),
    target_probs `[B, N+1, V]` p, draft_probs `[B, N, V]` q, coins `[B, N+1]`, coins_final `[B]`,
    weights `[B]` or `[B, N]`. Returns (num_accepted `[B]`, tokens `[B, N+1]` padded with -1)."""
    b, n1 = cand.shape
    dev = target_probs.device
    predicts = torch.full((b * n1,), -1, dtype=torch.int32, device=dev)  # [B*(N+1)]
    accept_index = torch.full((b, n1), -1, dtype=torch.int32, device=dev)  # [B, N+1]
    accept_num = torch.zeros(b, dtype=torch.int32, device=dev)  # [B]
    retrive_index = torch.arange(b * n1, dtype=torch.int32, device=dev).view(b, n1)  # chain layout
    if weights is not None:  # what eagle_sample's hook publishes for this step (no mask, no greedy row)
        greedy = torch.zeros(b, dtype=torch.bool, device=dev)
        verify_hooks._step.ctx = verify_hooks.VerifyStep(weights, greedy, False, logits=None, bias=None)
    try:
        verify_hooks.chain_kernel_around(
            kernel,
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=cand.to(torch.int32),
            retrive_index=retrive_index,
            retrive_next_token=None,
            retrive_next_sibling=None,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=coins_final,
            target_probs=target_probs.clone(),  # eagle_sample's own buffer: the hook edits it in place
            draft_probs=draft_probs,
            threshold_single=1.0,
            threshold_acc=1.0,
            deterministic=True,
        )
    finally:
        verify_hooks._step.ctx = None
    return accept_num.long(), predicts.view(b, n1).long()


def _batch(b: int, seed: int, stationary: bool):
    """Random p `[B, N+1, V]`, q `[B, N, V]`, drafts x_i ~ q_i, coins; per-row laws unless stationary."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 if stationary else b
    p = torch.softmax(torch.randn(rows, N + 1, V, generator=g) * 1.5, -1).expand(b, N + 1, V)
    q = torch.softmax(torch.randn(rows, N, V, generator=g) * 1.5, -1).expand(b, N, V)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, N)  # [B, N]
    cand = torch.cat([torch.zeros(b, 1, dtype=torch.long), x], dim=1)  # [B, N+1]
    coins, final = torch.rand(b, N + 1, generator=g), torch.rand(b, generator=g)
    return p.contiguous(), q.contiguous(), cand, coins, final


def _weights(kind: str, b: int) -> torch.Tensor:
    if kind == "per_row":  # w cycles through the dial
        return torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])[torch.arange(b) % 5]  # [B]
    g = torch.Generator().manual_seed(5)
    return torch.rand(b, N, generator=g)  # [B, N]: a learned head's per-token w


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["per_row", "per_token"])
def test_kernel_matches_reference_token_for_token(kernel, kind):
    p, q, cand, coins, final = _batch(EQUALITY_ROWS, seed=1 if kind == "per_row" else 2, stationary=False)
    w = _weights(kind, EQUALITY_ROWS)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    acc, toks = run_kernel(kernel, d(cand), d(p), d(q), d(coins), d(final), d(w))
    ref_acc, ref_toks = chain_rejection_reference(cand, mix_target_probs(p, q, w), q, coins[:, :N], final)
    # The kernel compares and accumulates in float32 and the reference in float64: a coin that
    # lands within rounding of a boundary may go either way (probability ~1e-7 per draw).
    mismatched = int(((acc.cpu() != ref_acc) | (toks.cpu() != ref_toks).any(-1)).sum())
    assert mismatched <= int(1e-4 * EQUALITY_ROWS), f"{mismatched} of {EQUALITY_ROWS} rows differ"
    assert int(acc.min()) >= 0 and int(acc.max()) <= N


def test_kernel_hook_passes_w1_rows_through_unchanged(kernel):
    """w = 1 rows see stock SGLang: identical output with and without weights published."""
    p, q, cand, coins, final = _batch(40, seed=3, stationary=False)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    with_hook = run_kernel(kernel, d(cand), d(p), d(q), d(coins), d(final), d(torch.ones(40)))
    stock = run_kernel(kernel, d(cand), d(p), d(q), d(coins), d(final), None)
    assert torch.equal(with_hook[0], stock[0]) and torch.equal(with_hook[1], stock[1])


def _law_run(kernel, w: torch.Tensor, seed: int):
    p, q, cand, coins, final = _batch(LAW_TRIALS, seed=seed, stationary=True)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    acc, toks = run_kernel(kernel, d(cand), d(p), d(q), d(coins), d(final), d(w))
    return p[0], q[0], acc.cpu(), toks.cpu()


def _check_law(p, q, w: float, acc, toks) -> None:
    nu = w * p[:N] + (1 - w) * q  # [N, V]
    for j in range(N):
        reached = acc >= j  # position j is emitted iff drafts before it were accepted
        assert chi_square_pvalue(toks[reached, j], nu[j]) > ALPHA, f"position {j} does not follow ν"
    bonus = toks[acc == N, N]
    if bonus.numel() > 1000:
        assert chi_square_pvalue(bonus, p[N]) > ALPHA, "bonus does not follow p_N"
    beta = 1 - w * 0.5 * (p[:N] - q).abs().sum(-1)  # [N] per-position acceptance
    first = float((acc >= 1).sum())
    assert abs(binomial_z(first, acc.numel(), float(beta[0]))) < Z_BOUND


@cuda_only
@pytest.mark.parametrize("w", [1.0, 0.5, 0.0])
def test_kernel_output_law_is_nu(kernel, w):
    p, q, acc, toks = _law_run(kernel, torch.full((LAW_TRIALS,), w), seed=int(10 + 10 * w))
    if w == 0.0:
        assert bool((acc == N).all()), "w = 0 must accept every draft"
    _check_law(p, q, w, acc, toks)


@cuda_only
def test_mixed_batch_each_group_follows_its_own_law(kernel):
    w = (torch.arange(LAW_TRIALS) % 2).float()  # alternating w = 0 / w = 1 rows in one call
    p, q, acc, toks = _law_run(kernel, w, seed=31)
    for value in (0.0, 1.0):
        rows = w == value
        _check_law(p, q, value, acc[rows], toks[rows])


@cuda_only
def test_power_p_is_rejected_when_w_is_half(kernel):
    p, q, acc, toks = _law_run(kernel, torch.full((LAW_TRIALS,), 0.5), seed=41)
    assert chi_square_pvalue(toks[:, 0], p[0]) < 1e-12
