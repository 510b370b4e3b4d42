"""The gateway's health series (deploy/prometheus/rules reads them): dialspec:ready follows /ready,
and dialspec:acceptance_floor{tier} is a true lower bound of ensemble verification's acceptance."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.app import create_app
from server.gateway.metrics import acceptance_floor
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server


def _samples(text: str, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_ready_gauge_follows_readiness_and_floors_cover_every_tier():
    engine = ScriptedEngine()
    tiers = {"lite": 0.25, "standard": 0.5, "exact": 1.0}
    with live_server(create_app(engine, GatewaySettings(tiers=tiers, default_quality="exact"))) as srv:
        text = httpx.get(srv.url + "/metrics").text
        assert _samples(text, "dialspec:ready") == {(): 1.0}
        n = engine.info.num_draft_limit
        floors = _samples(text, "dialspec:acceptance_floor")
        assert floors == {(("tier", t),): pytest.approx(acceptance_floor(q, n)) for t, q in tiers.items()}
        engine.not_ready = "SGLang runtime unreachable"
        assert _samples(httpx.get(srv.url + "/metrics").text, "dialspec:ready") == {(): 0.0}


def test_acceptance_floor_values():
    assert acceptance_floor(0.0, 5) == 1.0 and acceptance_floor(1.0, 5) == 0.0
    assert acceptance_floor(0.25, 5) == pytest.approx((0.75 + 0.75**2 + 0.75**3 + 0.75**4 + 0.75**5) / 5)
    # a shorter chain only raises it: the largest N is the floor for adaptive rounds
    assert all(acceptance_floor(0.4, n) >= acceptance_floor(0.4, n + 1) for n in range(1, 10))


def test_acceptance_floor_bounds_any_pair():
    """Exact (no sampling): for random target/draft distributions p, q and every w, one draft's
    acceptance probability sum_x min(q, ν) with ν = w·p + (1-w)·q is >= 1 - w, so a chain of N
    accepts on average at least N·acceptance_floor(w, N) drafts; the floor is attained by disjoint
    p and q (the worst pair)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        vocab = int(rng.integers(2, 64))
        p, q = rng.dirichlet(np.full(vocab, 0.3), size=2)
        for w in np.linspace(0, 1, 11):
            a = np.minimum(q, w * p + (1 - w) * q).sum()
            assert a >= 1 - w - 1e-12
            for n in (1, 3, 5, 8):
                expected_ratio = sum(a**k for k in range(1, n + 1)) / n
                assert expected_ratio >= acceptance_floor(w, n) - 1e-12
    p, q = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    for w in (0.25, 0.5):
        a = np.minimum(q, w * p + (1 - w) * q).sum()
        assert a == pytest.approx(1 - w)
        assert sum(a**k for k in range(1, 6)) / 5 == pytest.approx(acceptance_floor(w, 5))
