#!/usr/bin/env python3
"""The embedded engine on CUDA, and the report of `scripts/gpu_smoke.sh`.

    python scripts/gpu_smoke.py engine --out DIR     greedy agreement CUDA vs CPU; tok/s AR vs SD
    python scripts/gpu_smoke.py report --out DIR     DIR/gpu-results.md from what the steps wrote

Needs only torch (CUDA), transformers, tokenizers and safetensors: no SGLang, no network, no
dialspec install (the repository root is put on the import path).

Greedy agreement: the same 24 task-suite prompts, all submitted at once (identical batches on
every device), temperature 0, speculative w = 1 (greedy ν = argmax p) and autoregressive. Floating
point differs between devices and dtypes, so a near-tie can flip an argmax and the rest of that
sequence; CUDA float32 vs CPU float32 must agree on >= 90 % of sequences (a bug in a kernel path
— masks, cache indexing, RoPE — breaks most of them), the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AGREEMENT_FLOOR = 0.90  # CUDA fp32 vs CPU fp32, identical greedy sequences
NUM_PROMPTS = 24
MAX_TOKENS = 48


def _prompt_ids(tok, n: int) -> list[list[int]]:
    from server.engine.model_pair import suite_prompts

    prompts = suite_prompts(n)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _greedy_outputs(device: str, dtype: str, mode: str, prompts: list[list[int]]) -> list[list[int]]:
    """Token ids per prompt, every request submitted at once."""
    from server.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from server.engine.protocol import GenerationRequest, SamplingOptions, VerifyOptions

    engine = EmbeddedEngine(
        EmbeddedEngineConfig(device=device, dtype=dtype, max_batch=len(prompts), max_context=512)
    )
    engine.start_sync()
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def sink_for(i):
        def sink(item):
            if isinstance(item, BaseException):
                errors.append(item)
                done.release()
                return
            out[i].extend(item.token_ids)
            if item.finish_reason is not None:
                done.release()

        return sink

    try:
        for i, ids in enumerate(prompts):
            req = GenerationRequest(
                f"g{i}", tuple(ids), SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS),
                VerifyOptions(mode=mode, weight=1.0),
            )  # fmt: skip
            engine.submit(req, sink_for(i))
        for _ in prompts:
            done.acquire()
    finally:
        engine.scheduler.stop()
    if errors:
        raise errors[0]
    return [out[i] for i in range(len(prompts))]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
        prefix.append(k / max(len(x), len(y), 1))
    return {"identical": same / len(a), "mean_prefix_fraction": sum(prefix) / len(prefix)}


def engine_main(out: Path, waves: int, trials: int) -> int:
    import torch
    from transformers import AutoTokenizer

    from server.engine.bench import run_bench, to_markdown
    from server.engine.embedded import default_pair_paths

    if not torch.cuda.is_available():
        print("gpu_smoke: torch sees no CUDA device", file=sys.stderr)
        return 2
    target, draft, _ = default_pair_paths()
    prompts = _prompt_ids(AutoTokenizer.from_pretrained(str(target)), NUM_PROMPTS)
    t0 = time.perf_counter()
    runs = {
        ("cpu", "float32", "speculative"): None,
        ("cuda", "float32", "speculative"): None,
        ("cuda", "bfloat16", "speculative"): None,
        ("cuda", "bfloat16", "autoregressive"): None,
        ("cpu", "bfloat16", "speculative"): None,
    }
    for key in runs:
        runs[key] = _greedy_outputs(*key, prompts)
    ref = runs[("cpu", "float32", "speculative")]
    checks = {
        "cuda_fp32_vs_cpu_fp32 (SD w=1)": _agreement(runs[("cuda", "float32", "speculative")], ref),
        "cuda_bf16_vs_cpu_bf16 (SD w=1)": _agreement(
            runs[("cuda", "bfloat16", "speculative")], runs[("cpu", "bfloat16", "speculative")]
        ),
        "cuda_bf16_vs_cpu_fp32 (SD w=1)": _agreement(runs[("cuda", "bfloat16", "speculative")], ref),
        "cuda_bf16 SD w=1 vs AR": _agreement(
            runs[("cuda", "bfloat16", "speculative")], runs[("cuda", "bfloat16", "autoregressive")]
        ),
    }
    passed = checks["cuda_fp32_vs_cpu_fp32 (SD w=1)"]["identical"] >= AGREEMENT_FLOOR
    greedy = {"prompts": len(prompts), "max_tokens": MAX_TOKENS, "checks": checks, "passed": passed,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    print(json.dumps(greedy, indent=2), flush=True)

    report = run_bench(
        target, draft, concurrency=(1, 8, 32), max_tokens=24, num_draft=5, temperature=1.0,
        include_hf=True, waves=waves, trials=trials, device="cuda", dtype="bfloat16",
    )  # fmt: skip
    report["meta"]["gpu"] = torch.cuda.get_device_name()
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine-greedy.json").write_text(json.dumps(greedy, indent=2))
    (out / "engine-bench.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report)
    (out / "engine-bench.md").write_text(md)
    print(md, flush=True)
    return 0 if passed else 1


def _junit_summary(path: Path) -> tuple[str, list[str]]:
    """'N passed, M failed, K skipped' and the failing test ids from a pytest junit XML file."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return "did not run (no junit file)", []
    root = ET.parse(path).getroot()
    failed, skipped, total = [], 0, 0
    for case in root.iter("testcase"):
        total += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
    return f"{total - len(failed) - skipped} passed, {len(failed)} failed, {skipped} skipped", failed


def report_main(out: Path, device_label: str) -> int:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [
        f"## {time.strftime('%Y-%m-%d')} — {device_label}",
        "",
        f"`scripts/gpu_smoke.sh` on {gpu}; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}"
        + _versions(),
        "",
    ]
    for label, name in (
        ("(a) verifier exactness tests on CUDA", "verifier.xml"),
        ("(b) SGLang's Triton chain kernel fed ν by the plugin hook", "kernel.xml"),
    ):
        summary, failed = _junit_summary(out / name)
        lines.append(f"**{label}**: {summary}" + "".join(f"\n- FAILED `{f}`" for f in failed))
        lines.append("")
    greedy_path = out / "engine-greedy.json"
    lines.append("**(c) embedded engine on CUDA**")
    lines.append("")
    if greedy_path.exists():
        g = json.loads(greedy_path.read_text())
        lines += [
            f"Greedy agreement ({g['prompts']} prompts, {g['max_tokens']} tokens; floor "
            f"{AGREEMENT_FLOOR:.0%} identical for CUDA fp32 vs CPU fp32): "
            f"{'pass' if g['passed'] else 'FAIL'}",
            "",
            "| comparison | identical sequences | mean matching prefix |",
            "|---|---|---|",
        ]
        for name, c in g["checks"].items():
            lines.append(f"| {name} | {c['identical']:.1%} | {c['mean_prefix_fraction']:.1%} |")
        lines.append("")
    else:
        lines += ["engine step did not finish (see the log)", ""]
    bench_md = out / "engine-bench.md"
    if bench_md.exists():
        body = bench_md.read_text().split("\n", 2)[2]  # drop the '# dialspec bench engine' title
        lines += ["Throughput (`run_bench`, bf16, N = 5, 24 tokens, T = 1):", "", body]
    (out / "gpu-results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _versions() -> str:
    parts = []
    for mod in ("triton", "transformers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            parts.append(f"{mod} missing")
    return ", " + ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("engine", "report"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--device-label", default="GPU")
    args = ap.parse_args()
    if args.step == "engine":
        return engine_main(args.out, args.waves, args.trials)
    return report_main(args.out, args.device_label)


if __name__ == "__main__":
    sys.exit(main())
