"""SGLang 0.5.23's real `eagle_sample` on CPU, on its rejection-sampling branch.

`eagle_sample` (sglang/srt/speculative/eagle_utils.py) is CUDA code only in a few places, which
are stood in here and nowhere else; everything between them is SGLang's own code, unchanged:
penalties (`acc_additive_penalties` from the real penalizer orchestrator, e.g. min_new_tokens),
`logit_bias`, the grammar `GrammarMask.apply`, `sampling_softmax` over the row temperatures,
top-k / top-p renorm, the coins, the kernel call and its keyword arguments.

Stood in (module attributes of eagle_utils / runtime_context, through pytest's monkeypatch):
    `_is_cpu` False          on a CPU build eagle_sample always takes its greedy branch
    `get_spec()`             STANDALONE, rejection sampling on, thresholds 1 (what the plugin asks)
    `top_k_renorm_prob`,     torch restatements of FlashInfer's renorms (keep the top k / the
    `top_p_renorm_prob`      smallest top set with mass ≥ top_p, renormalise); SGLang's Triton
                             fallbacks refuse CPU tensors
    `chain_speculative_sampling_triton`  whatever the test passes (the real kernel or a reference)
    `get_parallel()`, `is_dp_attention_enabled()`   one rank, no DP attention
The grammar object applies SGLang's own Triton bitmask op (`apply_token_bitmask_inplace_triton`,
what the xgrammar backend calls on CUDA); xgrammar itself is not installed here.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from tests.sglang_cpu import import_heavy


@functools.cache
def modules() -> SimpleNamespace:
    heavy = import_heavy()
    import sglang.srt.layers.dp_attention as dp_attention
    import sglang.srt.runtime_context as runtime_context
    from sglang.kernels.ops.grammar import bitmask_ops
    from sglang.srt.constrained.base_grammar_backend import GrammarMask
    from sglang.srt.sampling import penaltylib
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(
        eagle_utils=heavy["sglang.srt.speculative.eagle_utils"], dp_attention=dp_attention,
        runtime_context=runtime_context, bitmask_ops=bitmask_ops,
        GrammarMask=GrammarMask, penaltylib=penaltylib,
        SamplingBatchInfo=SamplingBatchInfo, SamplingParams=SamplingParams,
    )  # fmt: skip


def stand_in_platform(monkeypatch, kernel) -> None:
    """Point the real eagle_sample at CPU-runnable pieces (module doc); `kernel` is called as
    `chain_speculative_sampling_triton(**kwargs)`."""
    m = modules()
    eu = m.eagle_utils
    spec = SimpleNamespace(
        speculative_algorithm="STANDALONE", speculative_use_rejection_sampling=True,
        speculative_use_block_verification=False, speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=1.0,
    )  # fmt: skip
    one_rank = SimpleNamespace(
        tp_group=SimpleNamespace(world_size=1), attn_tp_group=SimpleNamespace(world_size=1)
    )
    monkeypatch.setattr(eu, "_is_cpu", False)
    monkeypatch.setattr(eu, "get_spec", lambda: spec)
    monkeypatch.setattr(eu, "top_k_renorm_prob", top_k_renorm)
    monkeypatch.setattr(eu, "top_p_renorm_prob", top_p_renorm)
    monkeypatch.setattr(eu, "chain_speculative_sampling_triton", kernel)
    monkeypatch.setattr(m.runtime_context, "get_parallel", lambda: one_rank)
    monkeypatch.setattr(m.dp_attention, "is_dp_attention_enabled", lambda: False)


def top_k_renorm(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """`[R, V]` probs kept on each row's top k (ties at the k-th value kept), renormalised."""
    k = top_ks.view(-1, 1).clamp(1, probs.shape[-1]).long()
    kth = probs.sort(-1, descending=True).values.gather(-1, k - 1)  # [R, 1]
    kept = torch.where(probs >= kth, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """`[R, V]` probs kept on the smallest top set whose mass reaches top_p, renormalised."""
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each entry
    keep_sorted = before < top_ps.view(-1, 1)
    kept = torch.where(keep_sorted.scatter(-1, order, keep_sorted), probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


class _Tokenizer:
    additional_stop_token_ids = None
    eos_token_id = None


class Req:
    """The attributes of SGLang's `Req` that sampling and the penalizers read."""

    def __init__(self, rid: str, vocab: int, **sampling):
        self.rid = rid
        self.sampling_params = modules().SamplingParams(**sampling)
        self.tokenizer = _Tokenizer()
        self.sampling_params.normalize(self.tokenizer)
        self.sampling_params.verify(vocab)
        self.eos_token_ids = None


class Batch:
    """A `ScheduleBatch` as eagle_sample reads it (weak-referenceable, for the penalizers)."""

    def __init__(self, reqs: list[Req], vocab: int, *, return_logprob: bool = False, device: str = "cpu"):
        m = modules()
        self.reqs, self.device = reqs, device
        self.forward_mode = SimpleNamespace(is_idle=lambda: False)
        self.seq_lens = torch.full((len(reqs),), 7, dtype=torch.int64, device=device)
        self.return_logprob = return_logprob
        self.sampling_info = sampling_batch_info(self, vocab)
        self.sampling_info.penalizer_orchestrator = m.penaltylib.BatchedPenalizerOrchestrator(
            vocab, self, {m.penaltylib.BatchedMinNewTokensPenalizer}
        )
        self.sampling_info.update_penalties()  # what the scheduler does before a decode step


def sampling_batch_info(batch: Batch, vocab: int):
    """SGLang's `SamplingBatchInfo` with the fields `from_schedule_batch` derives from the reqs
    (that constructor needs a published server config; the derivations are copied, the class and
    its methods are SGLang's)."""
    m = modules()
    sp = [r.sampling_params for r in batch.reqs]
    dev = batch.device
    bias = None
    if any(s.logit_bias for s in sp):
        bias = torch.zeros(len(sp), vocab)
        for i, s in enumerate(sp):
            for token, value in (s.logit_bias or {}).items():
                bias[i, int(token)] = value
        bias = bias.to(dev)
    return m.SamplingBatchInfo(
        temperatures=torch.tensor([s.temperature for s in sp], dtype=torch.float, device=dev).view(-1, 1),
        top_ps=torch.tensor([s.top_p for s in sp], dtype=torch.float, device=dev),
        top_ks=torch.tensor([s.top_k for s in sp], dtype=torch.int32, device=dev),
        min_ps=torch.tensor([s.min_p for s in sp], dtype=torch.float, device=dev),
        is_all_greedy=all(s.top_k <= 1 for s in sp), is_any_greedy=any(s.top_k <= 1 for s in sp),
        need_top_p_sampling=any(s.top_p != 1.0 for s in sp),
        need_top_k_sampling=any(s.top_k != (1 << 30) for s in sp),
        need_min_p_sampling=False, vocab_size=vocab, device=dev, logit_bias=bias,
    )  # fmt: skip


class BitmaskGrammar:
    """A grammar handle whose `apply_vocab_mask` is SGLang's Triton bitmask op (xgrammar's CUDA
    path; interpreted here at ~5 ms a row), or with `fast` the same bit semantics in torch (bit i
    of word k clear: token 32·k + i set to −inf); only the mask plumbing matters to eagle_sample."""

    def __init__(self, fast: bool = False):
        self.fast = fast

    def apply_vocab_mask(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        if not self.fast:
            modules().bitmask_ops.apply_token_bitmask_inplace_triton(logits, vocab_mask)
            return
        bits = (vocab_mask.long().unsqueeze(-1) >> torch.arange(32)) & 1  # [rows, words, 32]
        allowed = bits.view(vocab_mask.shape[0], -1)[:, : logits.shape[-1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))


def grammar_mask(allowed: torch.Tensor, fast: bool = False):
    """`GrammarMask` from `allowed` `[rows, V]` bool (rows = B·(N+1), one per verify slot)."""
    rows, v = allowed.shape
    words = (v + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)  # [rows, words]
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return modules().GrammarMask(BitmaskGrammar(fast), packed)


def verify_input(draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> SimpleNamespace:
    """`EagleVerifyInput` fields eagle_sample reads, chain layout (topk = 1): `draft_tokens`
    `[B, N+1]` (slot 0 = last committed token), `draft_probs` `[B, N, V]`."""
    b, n1 = draft_tokens.shape
    return SimpleNamespace(
        draft_token=draft_tokens.reshape(-1).to(torch.int64), draft_token_num=n1, max_tree_depth=n1,
        retrieve_index=torch.arange(b * n1, dtype=torch.int64, device=draft_tokens.device).view(b, n1),
        retrieve_next_token=None, retrieve_next_sibling=None, tree_topk=1, draft_probs=draft_probs,
        custom_mask=None, positions=None,
    )  # fmt: skip


def emitted(predict: torch.Tensor, accept_lens: torch.Tensor, accept_index: torch.Tensor) -> list[list[int]]:
    """Per row, the tokens SGLang commits: `predict[accept_index]` over the accepted length."""
    return [
        [int(predict[int(i)]) for i in accept_index[r, : int(accept_lens[r])]]
        for r in range(len(accept_lens))
    ]
