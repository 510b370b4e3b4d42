"""The GPU smoke's CPU-checkable parts: its report, its agreement metric, device plumbing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from server.engine.embedded.model.llama import rope_table

ROOT = Path(__file__).resolve().parents[1]


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rope_table_is_built_on_the_frequencies_device():
    # The engine first failed on CUDA because this table was built on the CPU.
    table = rope_table(torch.ones(4, device="meta"), 8)
    assert table.device.type == "meta" and tuple(table.shape) == (8, 4)


def test_agreement_counts_identical_sequences_and_prefixes():
    smoke = _smoke()
    got = smoke._agreement([[1, 2, 3], [1, 2, 3, 4], [5]], [[1, 2, 3], [1, 9, 3, 4], [6]])
    assert abs(got["identical"] - 1 / 3) < 1e-12
    assert abs(got["mean_prefix_fraction"] - (1 + 0.25 + 0) / 3) < 1e-12


def test_report_lists_failures_from_junit_files(tmp_path):
    (tmp_path / "verifier.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "report", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = (tmp_path / "gpu-results.md").read_text()
    assert report == out.stdout
    assert "1 passed, 1 failed, 1 skipped" in report and "FAILED `t::bad`" in report
    assert "(b) SGLang's Triton chain kernel fed ν by the plugin hook**: did not run" in report


def test_smoke_script_names_its_verbs_on_a_wrong_one():
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "bogus"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "usage" in out.stderr


def test_bench_options_are_bench_config_fields():
    """The GPU steps call `run_bench` with options checked only there: a renamed field would fail
    on the GPU node, not here."""
    from server.engine.embedded.bench.runner import BenchConfig

    smoke = _smoke()
    BenchConfig("t", "d", waves=1, trials=1, **smoke.ENGINE_BENCH)
    for _shape, options in smoke.BENCH_PAIRS.values():
        BenchConfig("t", "d", device="cuda", dtype="bfloat16", **options)


def test_bench_step_refuses_unknown_pairs_and_a_missing_gpu(tmp_path):
    script = str(ROOT / "scripts" / "gpu_smoke.py")
    argv = [sys.executable, script, "bench", "--out", str(tmp_path), "--pairs"]
    out = subprocess.run([*argv, "bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "--pairs takes some of embedded,qwen,llama8b" in out.stderr
    if not torch.cuda.is_available():
        out = subprocess.run([*argv, "embedded"], capture_output=True, text=True)
        assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_hook_timing_runs_end_to_end_on_the_cpu(tmp_path):
    """`scripts/gpu_hook_timing.py` as the GPU node runs it (no SGLang import: its stock step and
    the hooks need torch and the kernel file only), at toy sizes on the CPU, then in the report."""
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "scripts" / "gpu_hook_timing.py")
    argv = [
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--batch",
        "3",
        "--draft",
        "2",
        "--vocab",
        "64",
        "--iters",
        "1",
    ]
    out = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "hook-timing.md").read_text()
    for kind in ("all w = 1 (stock path)", "sampled, w = 0.5", "mixed w, greedy and sampled", "log-probs"):
        assert kind in table
    smoke = [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "report", "--out", str(tmp_path)]
    subprocess.run(smoke, capture_output=True, text=True, check=True)
    assert table in (tmp_path / "gpu-results.md").read_text()
