"""Reproducible seeds under the adaptive draft length (issue 31, part 3; tiny pair).

A seeded (or greedy) request must give the same tokens alone, in busy mixed batches and whatever
the host's timings, with the default adaptive N. The planner makes its N sequence a function of
its own history and the start-up cost profile (`planner/draft_planner.py`, module doc); these tests
check the tokens and the N sequences themselves, and that N really varies (else they prove
nothing). Fault retries: tests/test_engine_faults.py runs its exactness tests on an adaptive engine
too."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.embedded.planner.acceptance import AcceptanceEstimate
from server.engine.embedded.planner.draft_planner import DraftPlanner
from server.engine.embedded.row import RowMode
from server.engine.protocol import GenerationRequest, SamplingOptions
from tests.tiny_pair import drafting_costs
from verifier.dial import PolicyKind, Verification

MAX_BATCH = 4
MSG_SHORT = [{"role": "user", "content": "Tom has 12 apples"}]


def _head(h_draft, h_target, dial):
    """A stand-in learned head: w_t = dial/2 + 0.25·sigmoid(mean target state)."""
    return (0.5 * dial.view(-1, 1) + 0.25 * torch.sigmoid(h_target.mean(-1))).clamp(0, 1)  # [R, N]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    eng = EmbeddedEngine(
        EmbeddedEngineConfig(
            *tiny_pair, max_batch=MAX_BATCH, max_context=160, profile_budget_s=0.3, head=_head
        )
    )
    eng.start_sync()
    planner = eng.scheduler.models.planner
    planner.set_cost(drafting_costs(MAX_BATCH, eng.config.max_num_draft))
    # Planned as for one row (the engine plans seeded rows alone and for a full batch): on this
    # cost model a full batch of 4 never drafts, and N = 0 throughout would leave these tests no
    # power (the kinds' N differ, and a learned row's kind moves with its mean w_t).
    planner.alone_batch = 1
    yield eng
    asyncio.run(eng.stop())


# Seeded requests over the dial: exact, two static tiers (one with top-p), quality 0 (draft only), a
# greedy w < 1 row (its bonus, from p, depends on N too), and a learned row.
SEEDED = [
    dict(weight=1.0),
    dict(weight=0.5),
    dict(weight=0.25, top_p=0.9),
    dict(weight=0.0),
    dict(weight=0.5, temperature=0.0),
    dict(weight=0.6, dial=0.6),
]


def _request(engine, rid: str, text: str, seed: int | None, max_tokens: int, **kw) -> GenerationRequest:
    verify = Verification(**{k: kw.pop(k) for k in list(kw) if k in Verification.__dataclass_fields__})
    ids = tuple(engine.encode_chat([{"role": "user", "content": text}]))
    sampling = SamplingOptions(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)
    return GenerationRequest(rid, ids, sampling, verify, trace=True)


def _seeded(engine) -> list[GenerationRequest]:
    # 40 tokens, a multiple of max_n (8): the quality-0 row's rounds are max_n long alone and in any
    # batch (a batch's draft-only round is as long as the most any of its rows has left), so its N
    # sequence is comparable too.
    return [_request(engine, f"s{i}", f"prompt {i}", 100 + i, 40, **spec) for i, spec in enumerate(SEEDED)]


def _noise(engine, rng: random.Random, count: int) -> list[GenerationRequest]:
    """Unseeded requests at random qualities and lengths: they shape the batches and the live plan."""
    out = []
    for i in range(count):
        spec = rng.choice([dict(weight=1.0), dict(weight=0.3), dict(weight=0.0), dict(weight=0.8, top_k=20)])
        out.append(_request(engine, f"n{i}", f"noise {i}", None, rng.randint(8, 48), **spec))
    return out


async def _collect(engine, req) -> tuple[list[int], list[int]]:
    """(token ids, N of the round of each token)."""
    chunks = [c async for c in engine.generate(req)]
    return [t for c in chunks for t in c.token_ids], [p.num_draft for c in chunks for p in c.provenance]


def _together(engine, requests) -> list[tuple[list[int], list[int]]]:
    async def main():
        return await asyncio.gather(*[_collect(engine, r) for r in requests])

    return asyncio.run(main())


def test_seeded_requests_are_the_same_alone_and_in_busy_batches_under_any_timings(engine):
    planner = engine.scheduler.models.planner
    seeded = _seeded(engine)
    alone = [_together(engine, [r])[0] for r in seeded]
    # N varies within requests and across the dial, so the sequences below are a real test
    assert any(len(set(ns)) > 1 for _, ns in alone)
    assert len({tuple(ns) for _, ns in alone}) > 2

    rng = random.Random(0)
    for trial in range(2):
        if trial == 1:  # the host's live timings change: verification grows 50 ms a position
            _time_live(planner, _slowed(MAX_BATCH, planner.max_n, "score", lambda t: 0.05 * t))
        noise = _noise(engine, rng, 8)
        mixed = seeded + noise
        order = list(range(len(mixed)))
        rng.shuffle(order)
        results = _together(engine, [mixed[i] for i in order])
        by_request = {mixed[i].request_id: out for i, out in zip(order, results, strict=True)}
        for req, (tokens, ns) in zip(seeded, alone, strict=True):
            got_tokens, got_ns = by_request[req.request_id]
            assert got_ns == ns, f"{req.request_id}: N sequence differs in a busy batch (trial {trial})"
            assert got_tokens == tokens, f"{req.request_id}: output differs in a busy batch (trial {trial})"


def _slowed(max_batch: int, max_n: int, kind: str, seconds):
    """`drafting_costs` with stage `kind` taking `seconds(t)`."""
    model = drafting_costs(max_batch, max_n)
    for r, t in list(model.points[kind]):
        model.set(kind, r, t, seconds(t))
    return model


def _time_live(planner: DraftPlanner, cost) -> None:
    """What a host under another load would have measured: the live model only (the start-up
    profile stays; `set_cost` would pin both)."""
    planner.cost = cost


def _planned_row(weight: float, seed: bool):
    from types import SimpleNamespace

    from verifier import Policy

    mode = RowMode.of(Verification(weight=weight), None, strict_nu=False, reproducible=seed)
    return SimpleNamespace(
        mode=mode, num_draft=0, estimate=AcceptanceEstimate(), prior_weight=weight,
        policy=Policy(PolicyKind.ENSEMBLE), draft_lag=1, tokens_left=200,
    )  # fmt: skip


def test_a_reproducible_rows_n_reads_only_its_kind():
    """Planned alone on the start-up profile: the batch, the live cost model, TV̂ and its kind's
    pooled acceptance move a free row's N and never a reproducible row's, nor does its own
    evidence (rows of a kind share one round)."""
    max_n = 6
    planner = DraftPlanner(drafting_costs(8, max_n), max_n)

    def plan(rows):
        planner._held = (
            frozenset(),
            0,
            frozenset(),
        )  # a full plan each time (the hold: test_draft_planner.py)
        planner.assign(rows)
        return [row.num_draft for row in rows]

    seeded, free = _planned_row(0.5, seed=True), _planned_row(0.5, seed=False)
    for row in (seeded, free):
        row.estimate.observe([0.8] * 6)
    reference = plan([seeded])[0]
    assert reference > 0
    free_alone = plan([free])[0]
    free_in_batch = plan([free] + [_planned_row(1.0, False) for _ in range(7)])[0]
    assert free_in_batch != free_alone  # the batch moves a free row's N ...
    assert plan([seeded] + [_planned_row(1.0, False) for _ in range(7)])[0] == reference  # ... not this one's
    planner.acceptance.tv_sums = [90.0, 100.0]  # TV̂ 0.9
    planner.acceptance.kinds[(PolicyKind.ENSEMBLE, 0.5)] = [0.0, 400.0]  # its kind accepts nothing
    _time_live(planner, _slowed(8, max_n, "draft", lambda t: 0.05))
    assert plan([free])[0] == 0  # the host, TV̂ and its kind all say: do not draft
    assert plan([seeded])[0] == reference
    seeded.estimate.observe([0.0] * 40)
    assert plan([seeded])[0] == reference


def test_seeded_rows_are_planned_for_a_full_batch():
    """The safe side: a seeded row drafts only where drafting pays in a full batch of rows like it
    (and alone), which the joint plan of such a batch confirms; planned for one row, it drafted in
    batches where that lost (the bench's seeded c = 8 rows ran 0.63-0.72x plain decoding)."""
    max_n = 6
    for batch, drafts in ((1, True), (8, False)):
        planner = DraftPlanner(drafting_costs(8, max_n), max_n, alone_batch=batch)
        seeded = _planned_row(1.0, seed=True)  # its kind's prior: 1 - 0.3 = 0.7
        planner.assign([seeded])
        assert bool(seeded.num_draft) == drafts, batch
    free = [_planned_row(1.0, seed=False) for _ in range(8)]
    for row in free:
        row.estimate.observe([0.85] * 20)
    DraftPlanner(drafting_costs(8, max_n), max_n).assign(free)
    assert all(row.num_draft == 0 for row in free)


def test_a_seeded_row_drafts_only_where_that_gains_alone_and_in_a_full_batch():
    """It cannot see its load, so its kind's N must gain at both ends: where drafting pays in a
    full batch but loses alone (here the target's forward grows with its tokens at batch 1 only),
    it decodes plainly, although a free batch of 8 like it drafts; where drafting pays at both,
    it drafts."""
    from tests.test_draft_planner import _model

    max_n = 6
    cases = [  # score(r, t), draft(r), whether the seeded row drafts
        (lambda r, t: 4e-3 * (t if r == 1 else 1), lambda r: 1e-3, False),
        (lambda r, t: 4e-3, lambda r: 1e-3, True),
    ]
    for score, draft, drafts in cases:
        seeded = _planned_row(0.5, seed=True)
        DraftPlanner(_model(score, draft), max_n, alone_batch=8).assign([seeded])
        assert bool(seeded.num_draft) == drafts
        free = [_planned_row(0.5, seed=False) for _ in range(8)]
        DraftPlanner(_model(score, draft), max_n).assign(free)
        assert all(row.num_draft > 0 for row in free)


def test_a_seeded_row_prices_the_engines_own_time_per_round_and_step():
    """The start-up profile's overheads (`overhead_profile.py`) are part of a seeded row's price:
    a round's fixed Python is what drafting spreads over more tokens. Here drafting gains at most
    2.8 % (N = 1, under the margin) on the forwards alone, 24 % (N = 2) with 0.3 ms of Python a
    round and 0.2 a step."""
    from server.engine.embedded.planner.cost_model import CostModel

    def model(other: float, step: float) -> CostModel:
        m = CostModel()
        m.set("score", 1, 1, 1e-3)
        m.set("score", 1, 5, 1e-3)
        m.set("draft", 1, 1, 0.8e-3)
        if other:
            m.set("other", 1, 0, other)
            m.set("step", 1, 0, step)
        return m

    for other, step, drafts in ((0.0, 0.0, False), (0.3e-3, 0.2e-3, True)):
        seeded = _planned_row(0.5, seed=True)  # β = 1 − 0.5 · 0.3 = 0.85
        DraftPlanner(model(other, step), 4, alone_batch=1).assign([seeded])
        assert bool(seeded.num_draft) == drafts, (other, seeded.num_draft)


def test_seeded_rows_of_a_kind_draft_at_one_n():
    """Were a seeded row's N its own (from its evidence, its lag), a batch of rows of one tier
    would spread over several N and run one round per N each step (seeded lite at c = 8: 0.76x
    plain decoding, split between its kind's N and 0). Rows of a kind draft at the kind's N:
    over 40 rows of varied evidence on a cost model where drafting pays, one value."""
    import random

    from tests.test_draft_planner import overhead_bound

    rng = random.Random(0)
    planner = DraftPlanner(overhead_bound(), 8, alone_batch=8)
    rows = []
    for _ in range(40):
        row = _planned_row(0.25, seed=True)
        row.estimate.observe([rng.uniform(0.0, 1.0)] * rng.randint(0, 60))
        row.draft_lag, row.tokens_left = rng.randint(1, 40), rng.randint(1, 200)
        rows.append(row)
    planner.assign(rows)
    ns = {row.num_draft for row in rows}
    assert len(ns) == 1 and 0 not in ns, ns


def test_a_row_whose_round_did_not_run_is_planned_again_from_the_same_state(tiny_pair):
    """A batched round that raises in `advance` leaves the rows after the raising one without their
    round; the step's plan counted it for them (a plain round towards exploring). The scheduler
    undoes that count, so the next plan sees the same history as without the fault. Driven step by
    step on a scheduler of its own."""
    from server.engine.embedded.scheduler import Scheduler

    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=96, profile_budget_s=0.3))
    models = eng.load_models()
    from tests.test_draft_planner import compute_bound

    models.planner.set_cost(compute_bound())  # drafting never pays: a plain round each step
    sched = Scheduler(models, 2)
    ids = tuple(eng.encode_chat(MSG_SHORT))

    class Exploding:  # raises when the first round after the prefill's token is emitted
        fed = 0

        def feed(self, text):
            self.fed += 1
            if self.fed > 1:
                raise RuntimeError("stop filter bug")
            return text, False

        def flush(self):
            return ""

    def row(rid):  # w = 1, unseeded (planned with its batch; seeded rows never explore)
        request = GenerationRequest(rid, ids, SamplingOptions(max_tokens=8, ignore_eos=True))
        return eng.make_row(request, lambda _item: None)

    poison, innocent = row("poison"), row("innocent")
    poison.stopper = Exploding()
    for r in (poison, innocent):
        sched.submit(r)
    sched.step()  # admission: each row's first token from the prefill, then their first round
    assert poison.done and not innocent.done  # the poison raised first: the innocent never advanced
    assert innocent.rounds == 1 and innocent.num_draft == 0
    assert innocent.estimate.plain_rounds == 0  # the plan's count undone
    sched.step()
    assert innocent.rounds == 2 and innocent.estimate.plain_rounds == 1
