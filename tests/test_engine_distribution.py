"""With sampling, the engine emits exactly ν = w·p + (1−w)·q at every position, whatever N.

For one prompt we draw many short completions (different seeds, batched) and compare the
empirical frequencies of the token at each position t with its exact marginal
Σ_{y<t} ν(y_1)·…·ν(y_t | y_<t), where p and q come from `transformers` running the two checkpoints
(an independent implementation) through the same temperature/top-k transform. A position is
produced inside a round (an accepted draft), as a correction after a rollback, or as the bonus
after N accepted drafts, so the verifier, the bonus draft step and the cache bookkeeping are all
under test; the adaptive cases draw N per round (the engine's planner, or a random N in 0..4 —
any schedule that looks only at the past must leave the law unchanged).

Tolerance (derived, not tuned): Pearson chi-square over cells with expected count >= 5 (the rest
pooled into one cell), rejected only above the chi-square quantile at 1 − 1e-4 for its degrees of
freedom. Seeds are fixed, so the test is deterministic; a correct sampler fails with probability
1e-4 per case over seed choices, while a wrong law (under strict ν the bonus drawn from p when
w < 1, or acceptance against p) shifts a position's law by (1−w)·TV(p, q) and the power checks show the
statistic then exceeds its limit.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chi2
from transformers import AutoModelForCausalLM

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.embedded.planner.draft_planner import DraftPlanner
from server.engine.protocol import GenerationRequest, SamplingOptions
from verifier import logits_to_probs
from verifier.dial import Verification

SAMPLES = 1000
TEMPERATURE = 0.8  # != 1 and top-k on, so the shared transform is exercised too
TOP_K = 6  # also keeps the support small enough for well-filled chi-square cells


class RandomLengths(DraftPlanner):
    """Any N in 0..4 per adaptive row and round, from its own seeded stream (never the future)."""

    rng = random.Random(0)

    def assign(self, rows) -> None:
        for row in rows:
            if row.mode.adaptive:
                row.num_draft = self.rng.randrange(0, 5)


def never_drafts(cost, max_n):
    """The engine's planner pinned to N = 0, as where drafting cannot pay."""
    planner = DraftPlanner(cost, max_n)
    planner.force = 0
    return planner


@pytest.fixture(scope="module")
def hf_pair(tiny_pair):
    target_path, draft_path = tiny_pair
    return (
        AutoModelForCausalLM.from_pretrained(target_path).eval(),
        AutoModelForCausalLM.from_pretrained(draft_path).eval(),
    )


def _next_probs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
    return logits_to_probs(logits.unsqueeze(0), TEMPERATURE, TOP_K)[0].double()  # [V]


def _marginals(hf_pair, prompt, weight, length, last_from_p=False, from_p=()):
    """Exact law of each of the first `length` tokens under ν (optionally p at the last one:
    the old bonus shortcut's law there, for the power check; and at the positions `from_p`)."""
    target, draft = hf_pair
    from_p = {*from_p, length - 1} if last_from_p else set(from_p)

    def law(ids, pos):
        p = _next_probs(target, ids)
        if pos in from_p:
            return p
        return weight * p + (1 - weight) * _next_probs(draft, ids)  # [V]

    out = []
    frontier = {(): 1.0}
    for pos in range(length):
        last = pos == length - 1
        marginal = None
        nxt: dict = {}
        for prefix, mass in frontier.items():
            nu = law([*prompt, *prefix], pos)
            marginal = mass * nu if marginal is None else marginal + mass * nu
            if not last:
                for y in nu.nonzero().flatten().tolist():
                    nxt[(*prefix, y)] = mass * float(nu[y])
        out.append(marginal)
        frontier = nxt
    return out


def _chi_square(counts: Counter, marginal: torch.Tensor, n: int) -> tuple[float, int]:
    """(statistic, dof); tokens outside the law's support fail the caller's check outright."""
    expected = {t: float(marginal[t]) for t in marginal.nonzero().flatten().tolist()}
    if not set(counts) <= set(expected):
        return float("inf"), 1
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


def _sample(tiny_pair, weight, length, num_draft, planner=None, strict=True):
    """`strict`: exactly ν in every round (`p_when_undrafted=False`), what most cases test."""
    target_path, draft_path = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            target_path, draft_path, num_draft=num_draft, max_context=64, max_waiting=SAMPLES,
            profile_budget_s=0.3, p_when_undrafted=not strict,
        )
    )  # fmt: skip
    prompt = engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}])

    async def main():
        await engine.start()
        if planner is not None:
            old = engine.scheduler.models.planner
            engine.scheduler.models.planner = planner(old.cost, engine.config.max_num_draft)
        try:

            async def one(seed):
                req = GenerationRequest(
                    f"r{seed}",
                    tuple(prompt),
                    SamplingOptions(
                        temperature=TEMPERATURE, top_k=TOP_K, max_tokens=length, seed=seed, ignore_eos=True
                    ),
                    Verification(weight=weight),
                )
                chunks = [c async for c in engine.generate(req)]
                return tuple(t for c in chunks for t in c.token_ids), chunks[-1].stats

            return await asyncio.gather(*[one(1000 + s) for s in range(SAMPLES)])
        finally:
            await engine.stop()

    results = asyncio.run(main())
    outputs = [o for o, _ in results]
    assert all(len(o) == length for o in outputs)
    return prompt, outputs, [s for _, s in results]


def _check_positions(outputs, marginals):
    for pos, marginal in enumerate(marginals):
        stat, dof = _chi_square(Counter(o[pos] for o in outputs), marginal, len(outputs))
        assert stat < float("inf"), f"position {pos + 1}: a token outside the support of ν"
        assert dof >= 3, "too few cells for a meaningful test"
        limit = chi2.ppf(1 - 1e-4, dof)
        assert stat < limit, f"position {pos + 1}: chi2={stat:.1f} over {dof} dof exceeds {limit:.1f}"


@pytest.mark.parametrize(
    "weight,num_draft,planner",
    [
        (0.5, 3, None),
        (1.0, 3, None),
        (0.5, None, None),
        (0.5, None, RandomLengths),
        (1.0, None, RandomLengths),
    ],
    ids=["w0.5-N3", "w1-N3", "w0.5-adaptive", "w0.5-randomN", "w1-randomN"],
)
def test_two_token_distribution_is_nu(tiny_pair, hf_pair, weight, num_draft, planner):
    prompt, outputs, stats = _sample(tiny_pair, weight, 2, num_draft, planner)
    if planner is RandomLengths:  # the schedule really varied: some rows drafted, some did not
        assert any(s.drafts for s in stats) and any(s.verify_steps > s.drafts for s in stats)
    _check_positions(outputs, _marginals(hf_pair, prompt, weight, 2))


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_bonus_position_is_nu(tiny_pair, hf_pair, weight):
    """N = 2: the third token is round one's bonus whenever both drafts were accepted (always at
    w = 0, where ν = q: the output is the draft model's). It follows ν, not p."""
    prompt, outputs, stats = _sample(tiny_pair, weight, 3, 2)
    if weight == 0.0:
        assert all(s.acceptance_rate == 1.0 and s.drafts == 1 for s in stats)
    marginals = _marginals(hf_pair, prompt, weight, 3)
    _check_positions(outputs, marginals)
    # Power: the law the bonus had before (p at position 3) is rejected by the same test.
    wrong = _marginals(hf_pair, prompt, weight, 3, last_from_p=True)[2]
    stat, dof = _chi_square(Counter(o[2] for o in outputs), wrong, len(outputs))
    assert stat > chi2.ppf(1 - 1e-4, dof)


def pinned_two(cost, max_n):
    """The engine's planner pinned to N = 2 for its adaptive rows (a bench's `--sweep 2`)."""
    planner = DraftPlanner(cost, max_n)
    planner.force = 2
    return planner


def test_an_adaptive_rows_bonus_is_drawn_from_p(tiny_pair, hf_pair):
    """The default engine: an adaptive w < 1 row draws its bonus from p, not ν (ν there costs a
    draft step and buys no token), like its first token (from the prefill, an N = 0 round). At
    w = 0 both drafts of the first round are always accepted: token 1 follows p, tokens 2-3 q = ν,
    and token 4, the bonus, p given them; the power check: the ν (= q) law at token 4, what
    `--strict-nu` draws, is rejected by the same test."""
    prompt, outputs, stats = _sample(tiny_pair, 0.0, 4, None, pinned_two, strict=False)
    assert all(s.drafts == 1 and s.acceptance_rate == 1.0 and s.target_only_rounds == 1 for s in stats)
    _check_positions(outputs, _marginals(hf_pair, prompt, 0.0, 4, from_p=(0, 3)))
    nu = _marginals(hf_pair, prompt, 0.0, 4, from_p=(0,))[3]
    stat, dof = _chi_square(Counter(o[3] for o in outputs), nu, len(outputs))
    assert stat > chi2.ppf(1 - 1e-4, dof)


def test_rounds_without_drafts_fall_back_to_p(tiny_pair, hf_pair):
    """The default engine (`p_when_undrafted`): where the planner drafts nothing, a w = 0.5 row
    draws from p — plain decoding's cost and law — and says so in its stats. The power check: the
    ν it would otherwise follow is rejected by the same test."""
    prompt, outputs, stats = _sample(tiny_pair, 0.5, 2, None, never_drafts, strict=False)
    assert all(s.drafts == 0 and s.target_only_rounds == s.verify_steps == 2 for s in stats)
    _check_positions(outputs, _marginals(hf_pair, prompt, 1.0, 2))
    nu = _marginals(hf_pair, prompt, 0.5, 1)[0]
    stat, dof = _chi_square(Counter(o[0] for o in outputs), nu, len(outputs))
    assert stat > chi2.ppf(1 - 1e-4, dof)


def test_strict_nu_without_drafts_keeps_nu(tiny_pair, hf_pair):
    """`p_when_undrafted=False`: the same N = 0 rounds draw from ν (one draft step per token)."""
    prompt, outputs, stats = _sample(tiny_pair, 0.5, 2, None, never_drafts, strict=True)
    assert all(s.drafts == 0 and s.target_only_rounds == 0 for s in stats)
    _check_positions(outputs, _marginals(hf_pair, prompt, 0.5, 2))


def test_quality_zero_from_the_draft_alone_is_q(tiny_pair, hf_pair):
    """Adaptive w = 0 rows decode from the draft alone (`draft_only.py`): three tokens of one
    draft-only round, each following ν = q; the power check: p's law is rejected by the same test."""
    prompt, outputs, stats = _sample(tiny_pair, 0.0, 3, None)
    assert all(s.draft_only_tokens == 3 and s.verify_steps == 0 for s in stats)
    _check_positions(outputs, _marginals(hf_pair, prompt, 0.0, 3))
    p = _marginals(hf_pair, prompt, 1.0, 1)[0]
    stat, dof = _chi_square(Counter(o[0] for o in outputs), p, len(outputs))
    assert stat > chi2.ppf(1 - 1e-4, dof)
