"""`dialspec bench engine --quick` on the tiny pair writes the JSON and markdown with every row."""

from __future__ import annotations

import json

import torch

from server.cli import main
from server.engine.bench import ENSEMBLE_WEIGHTS


def test_bench_engine_quick_writes_every_row(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench"
    argv = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft)]
    assert main([*argv, "--concurrency", "1,2", "--out", str(out)]) == 0
    report = json.loads((out / "engine.json").read_text())
    md = (out / "engine.md").read_text()
    methods = ["hf_generate", "dialspec_ar", "dialspec_sd"] + [f"dialspec_w{w}" for w in ENSEMBLE_WEIGHTS]
    got = {(r["method"], r["concurrency"]) for r in report["rows"]}
    # HF assisted generation is batch-1 only: measured once, at c = 1.
    expected = {(m, c) for m in methods for c in (1, 2)} | {("hf_assisted", 1), ("hf_assisted_w0.5", 1)}
    assert got == expected
    # Every concurrency serves the same workload: same requests, so the same token total.
    by = {(r["method"], r["concurrency"]): r for r in report["rows"]}
    for m in methods:
        assert by[(m, 1)]["tokens"] == by[(m, 2)]["tokens"]
    for r in report["rows"]:
        assert r["tokens_per_s"] > 0
        if r["method"].startswith("dialspec_") and r["method"] != "dialspec_ar":
            assert r["acceptance_rate"] is not None and r["predicted_speedup"] is not None
            assert 0 <= r["verify_fraction"] <= 1
        assert f"| {r['method']} | {r['concurrency']} |" in md
    assert {"sd_b1_vs_hf_assisted", "measured_over_predicted_min", "verify_fraction_max"} <= set(
        report["targets"]
    )


def test_bench_engine_user_mistakes_are_cli_errors(tmp_path, capsys):
    assert main(["bench", "engine", "--target", str(tmp_path)]) == 2
    assert main(["bench", "engine", "--target", str(tmp_path), "--draft", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_bench_engine_device_mistakes_are_cli_errors(tiny_pair, capsys):
    target, draft = tiny_pair
    base = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft)]
    assert main([*base, "--device", "gpu0"]) == 2
    assert "not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
