"""Peak memory of one verify step, SGLang's real `eagle_sample` bare vs through the plugin's hooks.

    PYTHONPATH=<tree> python -m tests.plugin_memory [--vocab 131072] [--batch 48] [--draft 5]

prints, per batch kind, the step's peak allocated bytes stock and hooked and the difference (the
plugin's extra peak), in units of one `[B, N, V]` float32 buffer. Run it with PYTHONPATH at an
older tree to measure an older plugin on the same inputs (docs/sglang.md, "Memory").

How: torch's profiler with `profile_memory=True` records every allocation and free of the CPU
allocator (c10's memory reporting, the CPU counterpart of CUDA's allocator statistics), including
temporaries inside composite ops; the running sum of those signed sizes, from the start of the
call, peaks at the step's peak allocated bytes above what existed before it. The inputs (logits,
q, the batch) are allocated before the measured call. SGLang's chain kernel is replaced by a
no-op (it allocates nothing: its outputs are allocated by eagle_sample, identically in both
runs), and FlashInfer's top-k renorm by one output allocation, as FlashInfer does.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn) -> tuple[int, object]:
    """`(peak allocated bytes above the start, fn())` from the profiler's allocator events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result


KINDS = {  # (w, greedy) per row, cycled over the batch
    "sampled, w < 1": [(0.5, False)],
    "mixed greedy/sampled": [(0.5, True), (0.3, False)],
    "sampled + log-probs": [(0.5, False)],
}


def measure(b: int, n: int, v: int, monkeypatch) -> dict[str, tuple[int, int]]:
    """`{kind: (stock peak, hooked peak)}` in bytes."""
    from server.sglang_plugin import verify_hooks
    from server.sglang_plugin.params import PluginSettings
    from tests import sglang_eagle_cpu as sgl_eagle

    sgl_eagle.stand_in_platform(
        monkeypatch, lambda **kw: verify_hooks.chain_kernel_around(lambda **_: None, **kw)
    )
    monkeypatch.setattr(
        sgl_eagle.modules().eagle_utils, "top_k_renorm_prob", lambda p, k: torch.empty_like(p)
    )
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    monkeypatch.setattr(verify_hooks, "_original_logprobs_requested", lambda: False)
    eagle_sample = sgl_eagle.modules().eagle_utils.eagle_sample
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(b * (n + 1), v, generator=g)
    q = torch.softmax(torch.randn(b, n, v, generator=g), -1)
    cand = torch.zeros(b, n + 1, dtype=torch.long)
    out = {}
    for kind, pattern in KINDS.items():
        rows = [pattern[i % len(pattern)] for i in range(b)]
        reqs = [
            sgl_eagle.Req(f"r{i}", v, temperature=0.0 if greedy else 0.9, custom_params={"dialspec_w": w})
            for i, (w, greedy) in enumerate(rows)
        ]
        batch = sgl_eagle.Batch(reqs, v, return_logprob="log-probs" in kind)
        hook = verify_hooks.make_eagle_sample_hook(PluginSettings(enabled=True))
        peaks = []
        for hooked in (False, True):
            output = SimpleNamespace(next_token_logits=logits0.clone())
            verify_input = sgl_eagle.verify_input(cand, q)
            if hooked:  # a first call builds the batch's plan (once per batch, not per step)
                hook(eagle_sample, verify_input, batch, SimpleNamespace(next_token_logits=logits0.clone()))
                args = (eagle_sample, verify_input, batch, output)
                peaks.append(peak_bytes(lambda a=args, h=hook: h(*a))[0])
            else:
                args = (verify_input, batch, output)
                peaks.append(peak_bytes(lambda a=args: eagle_sample(*a))[0])
            del output
        out[kind] = (peaks[0], peaks[1])
    return out


def body_peaks(b: int, n: int, v: int) -> dict[str, int]:
    """Peak bytes the plugin's two `[B, N, V]` passes allocate themselves (inputs preallocated):
    the kernel hook's ν̃ pass with greedy rows, a mask and a logit_bias (its costliest case), and
    the log-prob rewrite."""
    from server.sglang_plugin.ensemble import nu_into_target_probs_, nu_logprob_logits_

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(b, n + 1, v, generator=g)
    logits[..., :7] = float("-inf")  # a grammar mask
    target = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(b, n, v, generator=g), -1)
    bias = torch.zeros(b, v)
    bias[:, 9] = -100.0
    w = torch.full((b, n), 0.5)
    greedy = torch.arange(b) % 2 == 0
    temps = torch.full((b,), 0.9)
    nu, _ = peak_bytes(
        lambda: nu_into_target_probs_(target, q, w, logits=logits, bias=bias, greedy=greedy, any_greedy=True)
    )
    lp, _ = peak_bytes(lambda: nu_logprob_logits_(logits, q, w, temps, bias=bias))
    return {"kernel hook (ν̃ into target_probs)": nu, "log-prob rewrite": lp}


def main() -> None:
    import pytest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=131072)
    args = ap.parse_args()
    import transformers.models.auto.processing_auto  # noqa: F401  (import order: tests/conftest.py)

    unit = args.batch * args.draft * args.vocab * 4
    with pytest.MonkeyPatch.context() as mp:
        result = measure(args.batch, args.draft, args.vocab, mp)
    print(
        f"B={args.batch} N={args.draft} V={args.vocab}: one [B, N, V] float32 buffer = {unit / 2**20:.1f} MiB"
    )
    print("| kind | stock peak MiB | hooked peak MiB | plugin's extra MiB | extra / buffer |")
    print("|---|---|---|---|---|")
    for kind, (stock, hooked) in result.items():
        extra = hooked - stock
        mib = [f"{x / 2**20:.1f}" for x in (stock, hooked, extra)]
        print(f"| {kind} | {' | '.join(mib)} | {extra / unit:.2f} |")
    try:
        bodies = body_peaks(args.batch, args.draft, args.vocab)
    except ImportError:  # an older plugin without these passes
        return
    print("\n| plugin pass | own peak MiB | / buffer |\n|---|---|---|")
    for name, peak in bodies.items():
        print(f"| {name} | {peak / 2**20:.1f} | {peak / unit:.2f} |")


if __name__ == "__main__":
    main()
