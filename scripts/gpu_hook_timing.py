#!/usr/bin/env python3
"""Time the plugin's verify hooks against the stock verify step on the same inputs (GPU smoke).

    python scripts/gpu_hook_timing.py --out DIR [--batch 48] [--draft 5] [--vocab 131072]
                                      [--iters 50] [--device cuda]

The GPU smoke machine has no SGLang, so the stock step is `eagle_sample`'s rejection-sampling
branch (SGLang 0.5.23, sglang/srt/speculative/eagle_utils.py) restated in torch around SGLang's
real Triton chain kernel (the file `scripts/gpu_smoke.sh prepare` copies): temperature softmax,
top-k renorm (torch sort where SGLang uses FlashInfer), coins, the kernel. The hooked step is the
same function wrapped by the plugin's real hooks (`make_eagle_sample_hook`, `chain_kernel_around`),
so the difference is the plugin's overhead. Per batch kind: ms per step (CUDA events, median of
`--iters` after warm-up), the overhead, the peak allocated bytes above the inputs
(`torch.cuda.max_memory_allocated`) for both, and whether the hooked steady-state step ran clean
under `torch.cuda.set_sync_debug_mode("error")` (any host-device synchronisation raises).

Writes DIR/hook-timing.json and DIR/hook-timing.md. Needs torch and triton only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

KINDS = {  # (w, greedy) per row, cycled over the batch
    "all w = 1 (stock path)": [(1.0, False)],
    "sampled, w = 0.5": [(0.5, False)],
    "mixed w, greedy and sampled": [(0.5, True), (0.25, False), (1.0, False)],
    "sampled, w = 0.5, log-probs": [(0.5, False)],
}
TOP_K_ALL = 1 << 30


def top_k_renorm(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    k = top_ks.view(-1, 1).clamp(1, probs.shape[-1]).long()
    kth = probs.sort(-1, descending=True).values.gather(-1, k - 1)
    kept = torch.where(probs >= kth, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def stock_step(kernel):
    """eagle_sample's rejection-sampling branch, restated (module doc)."""

    def eagle_sample(verify_input, batch, logits_output, *args, **kwargs):
        bs, n1 = len(batch.reqs), verify_input.draft_token_num
        info, logits = batch.sampling_info, logits_output.next_token_logits
        dev = logits.device
        candidates = verify_input.draft_token.reshape(bs, n1)
        predict = torch.zeros(bs * n1, dtype=torch.int32, device=dev)
        accept_index = torch.full((bs, n1), -1, dtype=torch.int32, device=dev)
        accept = torch.empty(bs, dtype=torch.int32, device=dev)
        temps = torch.repeat_interleave(info.temperatures, n1, dim=0)  # [B·(N+1), 1]
        target_probs = torch.softmax(logits / temps, -1)
        if info.need_top_k_sampling:
            target_probs = top_k_renorm(target_probs, torch.repeat_interleave(info.top_ks, n1, dim=0))
        target_probs = target_probs.reshape(bs, n1, -1)
        coins = torch.rand_like(candidates, dtype=torch.float32)
        final = torch.rand((bs,), dtype=torch.float32, device=dev)
        kernel(
            predicts=predict, accept_index=accept_index, accept_token_num=accept, candidates=candidates,
            retrive_index=verify_input.retrieve_index, retrive_next_token=None, retrive_next_sibling=None,
            uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=target_probs,
            draft_probs=verify_input.draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True,
        )  # fmt: skip
        return predict, accept + 1, accept_index

    return eagle_sample


def make_inputs(kind: str, b: int, n: int, v: int, dev: torch.device):
    rows = [KINDS[kind][i % len(KINDS[kind])] for i in range(b)]
    params = [SimpleNamespace(custom_params={"dialspec_w": w}, top_k=1 if g else TOP_K_ALL) for w, g in rows]
    reqs = [SimpleNamespace(rid=f"r{i}", sampling_params=sp) for i, sp in enumerate(params)]
    greedy = torch.tensor([g for _, g in rows], device=dev)
    info = SimpleNamespace(
        temperatures=torch.where(greedy, 1.0, 0.9).view(-1, 1).float(), logit_bias=None,
        top_ks=torch.where(greedy, 1, TOP_K_ALL).int(), is_all_greedy=bool(all(g for _, g in rows)),
        need_top_k_sampling=any(g for _, g in rows),
    )  # fmt: skip
    batch = SimpleNamespace(
        reqs=reqs, sampling_info=info, forward_mode=SimpleNamespace(is_idle=lambda: False),
        return_logprob="log-probs" in kind,
    )  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(b * (n + 1), v, device=dev, generator=g)
    q = torch.softmax(torch.randn(b, n, v, device=dev, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, n)
    cand = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), drafts], 1)
    verify_input = SimpleNamespace(
        draft_token=cand.reshape(-1), draft_token_num=n + 1, draft_probs=q,
        retrieve_index=torch.arange(b * (n + 1), device=dev).view(b, n + 1),
    )  # fmt: skip
    return batch, verify_input, logits


def time_steps(call, logits, iters: int, dev: torch.device) -> tuple[float, int]:
    """(median ms per step, peak bytes above the inputs) of `call(logits_output)`."""
    times = []
    for i in range(iters + 3):  # 3 warm-up steps (kernel compile, the batch's plan)
        out = SimpleNamespace(next_token_logits=logits.clone())
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(out)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
            peak = torch.cuda.max_memory_allocated() - base
        else:
            t0 = time.perf_counter()
            call(out)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
            peak = 0
    return statistics.median(times), peak


def run(args) -> dict:
    from server.sglang_plugin import verify_hooks
    from server.sglang_plugin.params import PluginSettings
    from tests.sglang_kernel import load_chain_kernel

    dev = torch.device(args.device)
    kernel = load_chain_kernel(interpret=dev.type == "cpu").chain_speculative_sampling_triton
    verify_hooks._is_standalone = lambda: True  # no SGLang here: the server would say STANDALONE
    verify_hooks._original_logprobs_requested = lambda: False
    stock = stock_step(kernel)
    hooked_sample = stock_step(lambda **kw: verify_hooks.chain_kernel_around(kernel, **kw))
    results = {}
    for kind in KINDS:
        batch, verify_input, logits = make_inputs(kind, args.batch, args.draft, args.vocab, dev)
        hook = verify_hooks.make_eagle_sample_hook(PluginSettings(enabled=True))
        bare = lambda o, vi=verify_input, b=batch: stock(vi, b, o)  # noqa: E731
        hooked = lambda o, vi=verify_input, b=batch, h=hook: h(hooked_sample, vi, b, o)  # noqa: E731
        stock_ms, stock_peak = time_steps(bare, logits, args.iters, dev)
        hook_ms, hook_peak = time_steps(hooked, logits, args.iters, dev)
        sync_clean = None
        if dev.type == "cuda":  # the batch's plan exists now: a steady step must not synchronise
            torch.cuda.set_sync_debug_mode("error")
            try:
                hook(hooked_sample, verify_input, batch, SimpleNamespace(next_token_logits=logits.clone()))
                sync_clean = True
            except RuntimeError as exc:
                sync_clean = f"{exc}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results[kind] = dict(
            stock_ms=stock_ms, hook_ms=hook_ms, overhead_ms=hook_ms - stock_ms, stock_peak_bytes=stock_peak,
            hook_peak_bytes=hook_peak, sync_clean=sync_clean,
        )  # fmt: skip
        print(kind, json.dumps(results[kind]), flush=True)
    return results


def to_markdown(results: dict, args, device: str) -> str:
    buffer = args.batch * args.draft * args.vocab * 4
    lines = [
        f"Plugin hooks vs stock verify step on {device}: B = {args.batch}, N = {args.draft}, "
        f"V = {args.vocab} (median of {args.iters}; one [B, N, V] float32 buffer = {buffer / 2**20:.0f} MiB)",
        "",
        "| batch | stock ms | hooked ms | overhead ms | stock peak MiB | hooked peak MiB | extra / buffer "
        "| no sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        extra = (r["hook_peak_bytes"] - r["stock_peak_bytes"]) / buffer
        lines.append(
            f"| {kind} | {r['stock_ms']:.3f} | {r['hook_ms']:.3f} | {r['overhead_ms']:+.3f} | "
            f"{r['stock_peak_bytes'] / 2**20:.0f} | {r['hook_peak_bytes'] / 2**20:.0f} | {extra:.2f} | "
            f"{'yes' if r['sync_clean'] is True else r['sync_clean']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--draft", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hook_timing: torch sees no CUDA device", file=sys.stderr)
        return 2
    results = run(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "out": str(args.out), "device": device}
    (args.out / "hook-timing.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    md = to_markdown(results, args, device)
    (args.out / "hook-timing.md").write_text(md)
    print(md)
    return 0 if all(r["sync_clean"] in (True, None) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
