"""With sampling, the engine emits exactly ν = w·p + (1−w)·q at every position.

For one prompt we draw many two-token completions (different seeds, N = 3, batched) and compare
the empirical frequencies of y1 with ν1 and of y2 with its exact marginal Σ_y1 ν1(y1)·ν2(· | y1),
where p and q come from `transformers` running the two checkpoints (an independent implementation)
through the same temperature/top-k transform. Position 2 is
produced either inside the first round (after an accepted draft) or by the next round after a
rollback, so both the verifier and the cache bookkeeping are under test.

Tolerance (derived, not tuned): Pearson chi-square over cells with expected count >= 5 (the rest
pooled into one cell), rejected only above the chi-square quantile at 1 − 1e-4 for its degrees of
freedom. Seeds are fixed, so the test is deterministic; a correct sampler fails with probability
1e-4 per case over seed choices, while a wrong acceptance rule (e.g. verifying against p when
w < 1) shifts ν by (1−w)·TV(p, q) and blows the statistic up by orders of magnitude.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from scipy.stats import chi2
from transformers import AutoModelForCausalLM

from server.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.protocol import GenerationRequest, SamplingOptions, VerifyOptions
from verifier import logits_to_probs

SAMPLES = 1000
TEMPERATURE = 0.8  # != 1 and top-k on, so the shared transform is exercised too
TOP_K = 6  # also keeps the support small enough for well-filled chi-square cells


def _next_probs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
    return logits_to_probs(logits.unsqueeze(0), TEMPERATURE, TOP_K)[0].double()  # [V]


def _chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    big = {cell: e * n for cell, e in expected.items() if e * n >= 5}
    stat, pooled_obs = 0.0, n
    for cell, e in big.items():
        stat += (counts.get(cell, 0) - e) ** 2 / e
        pooled_obs -= counts.get(cell, 0)
    pooled_exp = n - sum(big.values())
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        return stat, len(big)
    assert pooled_obs <= max(5.0, 3 * pooled_exp + 5), "mass where ν has (almost) none"
    return stat, len(big) - 1


@pytest.mark.parametrize("weight", [0.5, 1.0])
def test_two_token_distribution_is_nu(tiny_pair, weight):
    """N = 3, two tokens: accepted drafts and corrections (the bonus never comes into play)."""
    prompt, outputs, _ = _sample(tiny_pair, weight, 2, 3)
    _check_positions(outputs, _marginals(tiny_pair, prompt, weight, 2))


def _check_positions(outputs, marginals):
    for pos, marginal in enumerate(marginals):
        stat, dof = _stat(outputs, pos, marginal)
        assert stat < float("inf"), f"position {pos + 1}: a token outside the support of ν"
        assert dof >= 3, "too few cells for a meaningful test"
        limit = chi2.ppf(1 - 1e-4, dof)
        assert stat < limit, f"position {pos + 1}: chi2={stat:.1f} over {dof} dof exceeds {limit:.1f}"


def _sample(tiny_pair, weight, length, num_draft):
    target_path, draft_path = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            target_path, draft_path, num_draft=num_draft, max_context=64, max_waiting=SAMPLES
        )
    )
    prompt = engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}])

    async def main():
        await engine.start()
        try:

            async def one(seed):
                req = GenerationRequest(
                    f"r{seed}",
                    tuple(prompt),
                    SamplingOptions(
                        temperature=TEMPERATURE, top_k=TOP_K, max_tokens=length, seed=seed, ignore_eos=True
                    ),
                    VerifyOptions(weight=weight),
                )
                chunks = [c async for c in engine.generate(req)]
                return tuple(t for c in chunks for t in c.token_ids), chunks[-1].stats

            return await asyncio.gather(*[one(1000 + s) for s in range(SAMPLES)])
        finally:
            await engine.stop()

    results = asyncio.run(main())
    assert all(len(o) == length for o, _ in results)
    return prompt, [o for o, _ in results], [s for _, s in results]


def _marginals(tiny_pair, prompt, weight, length, last_from_p=False):
    """Exact law of each of the first `length` tokens under ν (p at the last one with
    `last_from_p`: the law the bonus had before it was drawn from ν, for the power check)."""
    target = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()

    def law(ids, last):
        p = _next_probs(target, ids)
        return p if last and last_from_p else weight * p + (1 - weight) * _next_probs(draft, ids)  # [V]

    out, frontier = [], {(): 1.0}
    for pos in range(length):
        last, marginal, nxt = pos == length - 1, None, {}
        for prefix, mass in frontier.items():
            nu = law([*prompt, *prefix], last)  # [V]
            marginal = mass * nu if marginal is None else marginal + mass * nu
            if not last:
                for y in nu.nonzero().flatten().tolist():
                    nxt[(*prefix, y)] = mass * float(nu[y])
        out.append(marginal)
        frontier = nxt
    return out


def _stat(outputs, pos, marginal):
    counts = Counter(o[pos] for o in outputs)
    expected = {t: float(marginal[t]) for t in marginal.nonzero().flatten().tolist()}
    if not set(counts) <= set(expected):
        return float("inf"), 1
    return _chi_square(counts, expected, len(outputs))


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_bonus_position_is_nu(tiny_pair, weight):
    """N = 2: the third token is round one's bonus whenever both drafts were accepted (always at
    w = 0, where ν = q and the output is the draft model's). It follows ν, not p; the power check
    shows the same test rejects the law the bonus had when it was drawn from p."""
    prompt, outputs, stats = _sample(tiny_pair, weight, 3, 2)
    if weight == 0.0:
        assert all(s.acceptance_rate == 1.0 and s.drafts == 1 for s in stats)
    _check_positions(outputs, _marginals(tiny_pair, prompt, weight, 3))
    wrong = _marginals(tiny_pair, prompt, weight, 3, last_from_p=True)[2]
    stat, dof = _stat(outputs, 2, wrong)
    assert stat > chi2.ppf(1 - 1e-4, dof), "the test cannot tell ν from p at the bonus position"
