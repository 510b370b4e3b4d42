"""The engine's own model code reproduces `transformers` logits on the same weights.

Tolerance: float32 on CPU, max |Δlogit| <= 1e-4 absolute (observed ~1e-6; the gap is summation
order in fused q/k/v and gate/up matmuls and SDPA vs eager attention). Checked for full prompts,
for ragged incremental decoding through the per-row KV cache in arbitrary slots, for a Qwen2-style
model (q/k/v bias, tied embeddings) and for llama3 RoPE scaling.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from server.engine.embedded.model import llama
from server.engine.embedded.model.llama import ModelArgs, linear, load_model, rope_inv_freq

ATOL = 1e-4


def _hf_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(ids).logits  # [B, T, V]


def _ours_full(path, ids):
    m = load_model(path)
    cache = m.new_cache(ids.shape[0], ids.shape[1] + 4)
    slots = torch.arange(ids.shape[0])
    return m.logits(m(ids, slots, torch.zeros_like(slots), cache))


def test_full_forward_matches_transformers(tiny_pair):
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))  # [2, 17]
    for path in tiny_pair:
        ref, ours = _hf_logits(path, ids), _ours_full(path, ids)
        assert (ours - ref).abs().max().item() < ATOL


@pytest.fixture(params=["F.linear", "small-M"])
def matmul_path(request, monkeypatch):
    """Run a test with the stock matmuls, and with `llama.linear`'s transposed small-M product
    taken for every weight (real-size weights take it; the tiny test models are below its size
    threshold)."""
    if request.param == "small-M":
        monkeypatch.setattr(llama, "_LARGE_WEIGHT", 0)
    return request.param


def test_small_m_linear_equals_f_linear():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 1024, generator=g) * 0.02  # [N, K]: at the size threshold
    b = torch.randn(4096, generator=g)
    for shape in [(1, 1), (1, 2), (2, 3), (1, 16), (17,), (2, 9), (8, 9), (128,), (129,)]:
        x = torch.randn(*shape, 1024, generator=g)  # [..., K]
        ref = torch.nn.functional.linear(x, w, b)
        out = linear(x, w, b)
        assert out.shape == ref.shape and out.is_contiguous()
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
        rows = x.numel() // 1024
        if 2 <= rows <= 128:  # the transposed product was taken (bit-equal to computing it directly)
            assert torch.equal(out.reshape(rows, -1), (w @ x.reshape(rows, -1).t()).t() + b)


def test_ragged_incremental_decoding_matches_transformers(tiny_pair, matmul_path):
    """Two rows in non-contiguous slots, prefilled to different lengths, then decoded in chunks."""
    target, _ = tiny_pair
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))  # [2, 20]
    ref = _hf_logits(target, ids)  # [2, 20, V]
    m = load_model(target)
    cache = m.new_cache(4, 32)
    slots = torch.tensor([3, 1])
    lens = [5, 9]
    for b, n in enumerate(lens):  # prefill each row alone, as the scheduler does
        m(ids[b : b + 1, :n], slots[b : b + 1], torch.zeros(1, dtype=torch.long), cache)
    # Now advance both rows 3 positions at a time from their own lengths (ragged batch).
    for step in range(3):
        starts = torch.tensor([lens[0] + 3 * step, lens[1] + 3 * step])  # [2]
        toks = torch.stack([ids[b, s : s + 3] for b, s in enumerate(starts.tolist())])  # [2, 3]
        out = m.logits(m(toks, slots, starts, cache))  # [2, 3, V]
        for b, s in enumerate(starts.tolist()):
            assert (out[b] - ref[b, s : s + 3]).abs().max().item() < ATOL
    # Rollback: rewrite row 0 from an earlier length with other tokens; must match a fresh forward.
    alt = ids.clone()
    alt[0, 6:9] = torch.tensor([7, 8, 9])
    ref_alt = _hf_logits(target, alt[:1, :9])
    out = m.logits(m(alt[:1, 6:9], slots[:1], torch.tensor([6]), cache))
    assert (out[0] - ref_alt[0, 6:9]).abs().max().item() < ATOL


def test_qwen2_bias_and_tied_embeddings(tmp_path, matmul_path):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # non-zero biases so the bias path is exercised
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (1, 12))
    assert ModelArgs.from_hf_config(cfg.to_dict()).qkv_bias
    assert (_ours_full(tmp_path, ids) - _hf_logits(tmp_path, ids)).abs().max().item() < ATOL


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    torch.manual_seed(0)
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0,
    }  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, rope_scaling=scaling, rope_theta=500000.0,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    import json

    saved = json.loads((tmp_path / "config.json").read_text())
    args = ModelArgs.from_hf_config(saved)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**saved), "cpu")
    assert torch.allclose(rope_inv_freq(args), ref_inv.float(), rtol=1e-5, atol=1e-9)
    ids = torch.randint(0, 96, (1, 80))  # beyond the original context, where scaling matters
    assert (_ours_full(tmp_path, ids) - _hf_logits(tmp_path, ids)).abs().max().item() < ATOL


def test_cuda_attention_leaves_out_cudnn_and_cpu_is_unchanged():
    """cuDNN attention builds a plan per (rows, T, keys) shape, i.e. nearly every decode step (see
    llama.py's module doc): forwards on CUDA run without it, and the global flags come back after."""
    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    with llama.attention_backends(torch.device("cuda")):
        assert not flags.cudnn_sdp_enabled()
        assert flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
    with llama.attention_backends(torch.device("cpu")):
        assert flags.cudnn_sdp_enabled() == before[0]
