"""`--dtype auto`: the model dtype this pair runs fastest in on this machine.

On CUDA, bfloat16 (tensor cores; float32 only costs bandwidth). On a CPU the answer depends on
the host: without native bf16 instructions bfloat16 halves the bytes read per token but its
matmuls convert on the fly, and which effect wins differs by shape and batch size (measured on
a 2-core AVX2 host for the Qwen2.5-1.5B shape: one token 183 ms bf16 vs 388 ms fp32, eight
rows 2.05 s bf16 vs 1.35 s fp32). So `choose_dtype` measures it, bounded:

    for float32 and bfloat16, a one-layer copy of each model (same shapes, constant weights: speed
    does not depend on values) times one decoder layer and the LM head at 1 row and at max_batch
    rows, and one decoder layer over a 64-token prompt; per decoded token layers·t_layer + t_head,
    per prompt token (layers·t_layer(64) + t_head) / 64, target plus draft; a request of as many
    prompt tokens as generated ones costs prompt + decode(R) per token pair, and the dtype with
    the lower geometric mean of that cost at R = 1 and R = max_batch (low and full load) wins. Each time
    is the best of two passes in the order A B B A (two runs each, after a warm-up), so a burst of
    load on a shared host slows both candidates or neither. About 12 s for the Qwen2.5-1.5B/0.5B
    shapes on a 2-core host, a fraction of loading them.

Why the prompt counts: a prefill is compute-bound, and without bf16 matmul units bfloat16 is the
slow dtype for compute. Measured for the Qwen2.5 0.5B -> 1.5B shapes on a 2-core AVX2 host, per
token: decode bf16 0.27-0.34 vs fp32 0.58-0.81 s at batch 1, 0.21-0.25 vs 0.12-0.16 s at batch 8,
prompt 0.16 vs 0.034 s. A decode-only rule chose bf16 for max_batch 8, and a closed-loop c = 8
bench of 12-token replies then ran at 0.99 tok/s against 3.70 in fp32. With the prompt counted,
batch 1 alone still chooses bf16 (0.45 vs 0.61 s per prompt + reply token pair), max_batch 8 fp32.

The whole pair is then loaded once in that dtype (nothing converts per step). Decisions are cached
as JSON next to the cost models (per shapes, device, threads, max_batch, torch and engine code:
`cost_profile.code_digest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", *DTYPES)
_CPU_CANDIDATES = ("float32", "bfloat16")


_PROMPT = 64  # tokens of the prompt whose prefill is timed


def _per_token_seconds(config: dict, dtype: torch.dtype, rows: tuple[int, ...], reps: int) -> dict:
    """Seconds per token of one decode step at each row count, and per token of a 64-token prompt
    (key "prompt"), estimated from one layer: a one-layer copy of the model (constant weights;
    the embedding cut to a few rows, as a step reads few of its rows) times the layer and the LM
    head separately."""
    from server.engine.embedded.model.llama import ModelArgs, Transformer, rope_inv_freq, rope_table

    args = ModelArgs.from_hf_config(config)
    one = replace(args, num_layers=1)
    with torch.device("meta"):
        model = Transformer(one)
    model.embed = torch.nn.Embedding(8, args.hidden_size, device="meta")
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.02)
    model.inv_freq = rope_inv_freq(one)
    model.freqs_cis = rope_table(model.inv_freq, 0)
    cache = model.new_cache(max(rows), _PROMPT + 16)

    def best(fn) -> float:
        fn()  # first-call allocations and kernel set-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    out = {}
    with torch.inference_mode():
        for r in rows:
            tokens = torch.ones(r, 1, dtype=torch.long)  # [R, 1]
            slots, starts = torch.arange(r), torch.full((r,), 64)  # [R] each
            hidden = model(tokens, slots, starts, cache, True)  # [R, 1, H]
            t_layer = best(lambda: model(tokens, slots, starts, cache, True))  # noqa: B023
            t_head = best(lambda: model.logits(hidden).softmax(-1))  # noqa: B023
            out[r] = (args.num_layers * t_layer + t_head) / r
        prompt = torch.ones(1, _PROMPT, dtype=torch.long)  # [1, P]
        zero = torch.zeros(1, dtype=torch.long)  # [1]
        t_prompt = best(lambda: model(prompt, zero, zero, cache, True))
        out["prompt"] = (args.num_layers * t_prompt + t_head) / _PROMPT  # logits at its last token only
    return out


def measure_cpu(target_path: Path, draft_path: Path, max_batch: int, reps: int = 2) -> dict:
    """Per-token costs (seconds) of target + draft by dtype name: decoding at batch 1 and
    max_batch, and reading a prompt; the best of two passes over the candidates in the order
    A B B A (`reps` runs each), and the score that ranks them (see the module doc)."""
    configs = [json.loads((Path(p) / "config.json").read_text()) for p in (target_path, draft_path)]
    rows = tuple(sorted({1, max_batch}))
    best: dict[str, list[dict]] = {}  # name -> per model, seconds per token by rows (and "prompt")
    for name in (*_CPU_CANDIDATES, *reversed(_CPU_CANDIDATES)):
        per = [_per_token_seconds(c, DTYPES[name], rows, reps) for c in configs]
        seen = best.setdefault(name, per)
        best[name] = [{k: min(a[k], b[k]) for k in a} for a, b in zip(seen, per, strict=True)]
    out: dict[str, dict] = {}
    for name in _CPU_CANDIDATES:
        per = best[name]
        decode = {r: sum(p[r] for p in per) for r in rows}
        prompt = sum(p["prompt"] for p in per)
        out[name] = {
            **{f"batch{r}_s_per_token": s for r, s in decode.items()},
            "prompt_s_per_token": prompt,
            # one prompt token and one generated token, at each load; geometric mean over loads
            "score": math.prod(prompt + s for s in decode.values()) ** (1 / len(decode)),
        }
    return out


def choose_dtype(
    target_path: Path,
    draft_path: Path,
    device: torch.device,
    max_batch: int,
    cache_dir: Path | None = None,
) -> tuple[torch.dtype, dict]:
    """(dtype, why) for `--dtype auto` (see the module doc)."""
    if device.type == "cuda":
        return torch.bfloat16, {"rule": "cuda: bfloat16"}
    from server.engine.embedded.planner.cost_profile import code_digest, device_name

    key = {
        "configs": [json.loads((Path(p) / "config.json").read_text()) for p in (target_path, draft_path)],
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "max_batch": max_batch,
        "torch": torch.__version__,
        "code": code_digest(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"dtype-{digest}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            why = json.loads(path.read_text())
            return DTYPES[why["dtype"]], why | {"source": "cache"}
        except (KeyError, ValueError):
            pass
    t0 = time.perf_counter()
    timings = measure_cpu(Path(target_path), Path(draft_path), max_batch)
    best = min(timings, key=lambda name: timings[name]["score"])
    why = {
        "dtype": best,
        "rule": "cpu: lower geometric mean over 1 and max_batch rows of prompt + decode cost per token",
        "timings": timings,
        "probe_s": round(time.perf_counter() - t0, 3),
    }
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(why, indent=1) + "\n")
    return DTYPES[best], why | {"source": "probe"}
