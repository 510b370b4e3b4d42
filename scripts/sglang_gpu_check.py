#!/usr/bin/env python3
"""GPU-node acceptance check of the dialspec SGLang plugin on a real draft/target pair.

Run on a machine with a GPU and `pip install -e '.[sglang]'` (see docs/sglang.md):

    python scripts/sglang_gpu_check.py --target meta-llama/Llama-3.1-8B-Instruct \
        --draft meta-llama/Llama-3.2-1B-Instruct -n 5

What it does (each server is started, probed and stopped by this script):
  1. Stock SGLang, STANDALONE, plugin off: greedy (temperature 0) generations and their
     `spec_accept_rate` per prompt.
  2. SGLang with the plugin on (`dialspec runtime` flags): the same greedy requests at w = 1 must
     give the same texts and acceptance as stock (greedy ν with w = 1 is argmax p, exactly what
     stock verifies), up to `--greedy-tolerance` of prompts differing (GPU batch nondeterminism).
  3. Same server, temperature 1 and greedy, sweeping w: the mean acceptance rate must not fall as
     w falls (allowing `--slack` for sampling noise), and w = 0 must accept (almost) every draft.

Exit status 0 when every check passes; a JSON report goes to `--report`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.runtime_cli import build_command  # noqa: E402
from server.sglang_plugin.params import ENV_ENABLE, custom_params_for  # noqa: E402
from verifier.dial import Verification  # noqa: E402

PROMPTS = [
    "Q: Tom has 12 apples and buys 7 more. How many apples does he have? A:",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in two sentences: The city council approved a budget of 45 million on Monday "
    "after a long debate about road repairs and school funding.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five prime numbers greater than 100 and explain how you checked them.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "def quicksort(xs):",
    "The three most important ideas in thermodynamics are",
]


def start_server(args, plugin: bool, port: int) -> subprocess.Popen:
    ns = argparse.Namespace(
        target=args.target,
        draft=args.draft,
        num_draft=args.num_draft,
        default_w=1.0,
        head=None,
        host="127.0.0.1",
        port=port,
        tp=args.tp,
        mem_fraction=args.mem_fraction,
        python=args.python,
        extra=[],
    )
    argv, env = build_command(ns)
    full_env = dict(os.environ)
    if plugin:
        full_env.update(env)
    else:
        # Stock: plugin off, and stock STANDALONE refuses rejection sampling, so drop the flag.
        full_env.pop(ENV_ENABLE, None)
        argv = [a for a in argv if a != "--speculative-use-rejection-sampling"]
    print(("plugin" if plugin else "stock") + ": " + " ".join(argv), flush=True)
    proc = subprocess.Popen(argv, env=full_env)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"SGLang exited with {proc.returncode} during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit("SGLang did not become healthy in time")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def generate(port: int, prompt: str, temperature: float, w: float | None, max_tokens: int, seed: int) -> dict:
    sp = {"temperature": temperature, "max_new_tokens": max_tokens, "sampling_seed": seed}
    if w is not None:
        sp["custom_params"] = custom_params_for(Verification(weight=w))
    resp = httpx.post(
        f"http://127.0.0.1:{port}/generate", json={"text": prompt, "sampling_params": sp}, timeout=600
    )
    resp.raise_for_status()
    data = resp.json()
    meta = data["meta_info"]
    return {
        "text": data["text"],
        "accepted": meta.get("spec_num_correct_drafts", 0),
        "proposed": meta.get("spec_num_proposed_drafts", 0),
    }


def run_set(port, temperature, w, args) -> list[dict]:
    jobs = [(p, s) for p in PROMPTS for s in range(args.samples)]
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        return list(
            pool.map(lambda job: generate(port, job[0], temperature, w, args.max_tokens, job[1]), jobs)
        )


def acceptance(results: list[dict]) -> float:
    proposed = sum(r["proposed"] for r in results)
    return sum(r["accepted"] for r in results) / proposed if proposed else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--num-draft", "-n", type=int, default=5)
    ap.add_argument("--weights", default="1.0,0.8,0.6,0.4,0.2,0.0")
    ap.add_argument("--samples", type=int, default=4, help="seeds per prompt at temperature 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--slack", type=float, default=0.02, help="allowed acceptance dip between w steps")
    ap.add_argument("--greedy-tolerance", type=float, default=0.1, help="share of prompts allowed to differ")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mem-fraction", type=float, default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--report", default="sglang_gpu_check.json")
    args = ap.parse_args()
    weights = [float(x) for x in args.weights.split(",")]
    failures: list[str] = []
    report: dict = {"target": args.target, "draft": args.draft, "num_draft": args.num_draft}

    proc = start_server(args, plugin=False, port=args.port)
    try:
        stock = [generate(args.port, p, 0.0, None, args.max_tokens, 0) for p in PROMPTS]
    finally:
        stop_server(proc)
    report["stock_greedy_acceptance"] = acceptance(stock)

    proc = start_server(args, plugin=True, port=args.port)
    try:
        ours = [generate(args.port, p, 0.0, 1.0, args.max_tokens, 0) for p in PROMPTS]
        differ = sum(a["text"] != b["text"] for a, b in zip(stock, ours, strict=True)) / len(PROMPTS)
        report["w1_greedy_acceptance"] = acceptance(ours)
        report["w1_greedy_texts_differing"] = differ
        if differ > args.greedy_tolerance:
            failures.append(f"greedy w=1 differs from stock on {differ:.0%} of prompts")
        if abs(acceptance(ours) - acceptance(stock)) > args.slack:
            failures.append(f"greedy w=1 acceptance {acceptance(ours):.4f} != stock {acceptance(stock):.4f}")
        for temperature in (1.0, 0.0):
            curve = {w: acceptance(run_set(args.port, temperature, w, args)) for w in weights}
            report[f"sweep_t{temperature:g}"] = curve
            print(f"temperature {temperature:g}: " + ", ".join(f"w={w:g}: {a:.3f}" for w, a in curve.items()))
            ordered = sorted(curve.items(), reverse=True)  # w from high to low
            for (w_hi, a_hi), (w_lo, a_lo) in zip(ordered, ordered[1:], strict=False):
                if a_lo < a_hi - args.slack:
                    failures.append(
                        f"t={temperature:g}: acceptance fell from {a_hi:.3f} (w={w_hi}) "
                        f"to {a_lo:.3f} (w={w_lo})"
                    )
            if 0.0 in curve and curve[0.0] < 0.99:
                failures.append(f"t={temperature:g}: w=0 accepted only {curve[0.0]:.3f} of drafts")
    finally:
        stop_server(proc)

    report["failures"] = failures
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
