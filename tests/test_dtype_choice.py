"""`--dtype auto` on CPU (server/engine/embedded/dtype_choice.py): a probe that a burst of host load cannot
tip, and a cache that never outlives the code it was measured with."""

from __future__ import annotations

import pytest
import torch

from server.engine.embedded import dtype_choice
from server.engine.embedded.planner import cost_profile


def test_a_burst_of_load_during_one_candidate_does_not_decide(tiny_pair, monkeypatch):
    """The candidates are timed A B B A and each keeps its best pass: bf16 is the faster one here,
    and its first pass runs during a burst that makes it look 10x slower."""
    calls = []

    def fake(config, dtype, rows, reps):
        calls.append(dtype)
        seconds = 0.010 if dtype == torch.float32 else 0.006
        if calls.count(torch.bfloat16) <= 2:  # the first bf16 pass (target and draft): a burst
            seconds *= 10
        return {**{r: seconds for r in rows}, "prompt": seconds}

    monkeypatch.setattr(dtype_choice, "_per_token_seconds", fake)
    timings = dtype_choice.measure_cpu(*tiny_pair, max_batch=4)
    f32, bf16 = torch.float32, torch.bfloat16
    assert calls == [f32, f32, bf16, bf16, bf16, bf16, f32, f32]  # each model, passes A B B A
    assert min(timings, key=lambda name: timings[name]["score"]) == "bfloat16"
    assert timings["bfloat16"]["batch1_s_per_token"] == 2 * 0.006  # target + draft, best pass


def test_prompt_cost_counts_beside_decode_cost(tiny_pair, monkeypatch):
    """bf16 decodes 2x faster at batch 1 and 1.25x slower at batch 8, and prefills 5x slower (a
    prefill is compute-bound: no bf16 matmul units). Per prompt + reply token pair that is
    fp32 (0.8 + 0.03)·(0.16 + 0.03) = 0.158 against bf16 (0.4 + 0.15)·(0.2 + 0.15) = 0.193 (squared
    geometric means): fp32, although the decode costs alone favour bf16 (0.128 vs 0.08); at batch 1
    alone, bf16 (0.55 vs 0.83)."""
    costs = {
        torch.float32: {1: 0.4, 8: 0.08, "prompt": 0.015},
        torch.bfloat16: {1: 0.2, 8: 0.1, "prompt": 0.075},
    }  # per model: target and draft alike, so the pair's costs are twice these
    monkeypatch.setattr(
        dtype_choice,
        "_per_token_seconds",
        lambda config, dtype, rows, reps: {k: costs[dtype][k] for k in (*rows, "prompt")},
    )
    timings = dtype_choice.measure_cpu(*tiny_pair, max_batch=8)
    decode_only = {name: t["batch1_s_per_token"] * t["batch8_s_per_token"] for name, t in timings.items()}
    assert min(decode_only, key=decode_only.get) == "bfloat16"
    assert min(timings, key=lambda name: timings[name]["score"]) == "float32"
    assert timings["float32"]["score"] == pytest.approx(((0.8 + 0.03) * (0.16 + 0.03)) ** 0.5)
    alone = dtype_choice.measure_cpu(*tiny_pair, max_batch=1)
    assert min(alone, key=lambda name: alone[name]["score"]) == "bfloat16"


def test_a_cached_choice_is_reused_until_the_engine_code_changes(tiny_pair, tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    first = dtype_choice.choose_dtype(*tiny_pair, cpu, 2, tmp_path)
    again = dtype_choice.choose_dtype(*tiny_pair, cpu, 2, tmp_path)
    assert first[1]["source"] == "probe" and again[1]["source"] == "cache" and again[0] == first[0]
    monkeypatch.setattr(cost_profile, "code_digest", lambda: "edited")
    assert dtype_choice.choose_dtype(*tiny_pair, cpu, 2, tmp_path)[1]["source"] == "probe"
