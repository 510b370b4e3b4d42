#!/usr/bin/env python3
"""Where one decode forward's time goes on CUDA: wall time vs GPU kernel time vs launches.

    python scripts/gpu_forward_profile.py [--shape qwen2.5-0.5b-1.5b] [--work /tmp/dialspec-gpu-bench]

Writes (or reuses) the random-weight synth pair of `dialspec pair synth`, loads its target with the
engine's own loader and times `Transformer.forward` at batch R and T tokens per row (T = 1 is a
decode step, T = N + 1 a verify): the median wall time per forward, and from `torch.profiler` the
summed CUDA kernel time and the number of kernel launches per forward. Wall far above kernel time
means the engine is bound by the host (Python and launch overhead), not by memory bandwidth; the
bandwidth floor (weights bytes / copy bandwidth) is printed beside it. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time_forward(model, cache, r: int, t: int, dev) -> dict:
    """Median wall ms of 30 forwards (after 5 warm-ups); kernel ms and launches per forward."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, model.args.vocab_size, (r, t), device=dev)  # [R, T]
    slots = torch.arange(r, device=dev)  # [R]
    starts = torch.full((r,), 100, dtype=torch.long, device=dev)  # [R]

    def fwd():
        with torch.inference_mode():
            return model.logits(model(tokens, slots, starts, cache, True))

    for _ in range(5):
        fwd()
    torch.cuda.synchronize()
    walls = []
    for _ in range(30):
        t0 = time.perf_counter()
        fwd()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    reps = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fwd()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return {
        "wall_ms": round(1e3 * statistics.median(walls), 3),
        "gpu_kernel_ms": round(sum(e.device_time for e in kernels) / 1e3 / reps, 3),
        "launches": len(kernels) // reps,
    }


def main() -> int:
    import torch

    from server.engine.embedded.model.llama import load_model
    from training.synth_pair import write_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b-1.5b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dialspec-gpu-bench"))
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_forward_profile: torch sees no CUDA device", file=sys.stderr)
        return 2
    pair_dir = args.work / f"synth-{args.shape}"
    if not (pair_dir / "pair.json").exists():
        write_pair(pair_dir, args.shape, device="cuda")
    dev = torch.device("cuda")
    rows = []
    for which in ("target", "draft"):
        model = load_model(pair_dir / which, device=dev, dtype=torch.bfloat16)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cache = model.new_cache(8, 512)
        for r, t in ((1, 1), (1, 6), (8, 1), (8, 6)):
            row = {
                "model": which,
                "R": r,
                "T": t,
                **_time_forward(model, cache, r, t, dev),
            }
            row.update(weights_gb=round(nbytes / 1e9, 3), bandwidth_floor_ms=round(nbytes / 3.0e12 * 1e3, 3))
            rows.append(row)  # the floor assumes ~3 TB/s of HBM3
            print(json.dumps(row), flush=True)
        del model, cache
        torch.cuda.empty_cache()
    print("\n| model | R | T | wall ms | GPU kernel ms | launches | bandwidth floor ms |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        cells = [
            x[k] for k in ("model", "R", "T", "wall_ms", "gpu_kernel_ms", "launches", "bandwidth_floor_ms")
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if args.out:
        report = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
