"""A lean decoder for Llama / Qwen2-family checkpoints in HF format (gpt-fast style).

Why our own model code: HF modules re-derive masks, positions and cache objects every call, which
dominates a step on CPU for small models; here a forward is the bare layer math over a
preallocated `KVCache`, with per-row start positions so ragged rows share one batched call.

Terms
    R       rows in this call (a subset of the cache's slots), T new positions per row.
    starts  `[R]` per-row absolute position of the first new token (= the row's cache length).
    hidden  final-norm last hidden states `[R, T, H]`: the LM-head inputs (what the learned
            weight head reads).

Supported: RMSNorm, RoPE (HF `rope_scaling`/`rope_parameters` types default and llama3), GQA,
SwiGLU, q/k/v bias (Qwen2 or `attention_bias`), tied embeddings. Weights load from `*.safetensors`.

Small-M matmuls on CPU (`linear`): MKL's float32 GEMM for `x [M, K] @ W.T` with 2 <= M <= 128 rows
runs far below the bandwidth bound on the AVX2 hosts measured here (a [17920, 1536] projection: 9 ms
at M = 1, 26-31 ms at M = 3..8), while the same product taken as `W @ x.T` streams W once (8-13 ms).
That is exactly the shape of a verify forward (T = N+1 positions) and of a small decode batch, so
`linear` takes the transposed product for 2..128 rows, for weights large enough to matter (>= 4M
elements; smaller ones measured no better). The bound was 16 until verify forwards at batch 8
(M = 8·(N+1) = 24..72) were measured: the same [17920, 1536] projection at M = 24 / 40 / 72 took
36 / 64 / 80 ms through `F.linear` against 28 / 49 / 50 ms transposed, the Qwen2.5 LM head
[151936, 1536] at M = 40 639 vs 292 ms, and a whole Qwen2.5-1.5B-shape forward at R = 8 rows and
T = 3 / 5 / 9 tokens went from 1.73-1.82 / 2.19-2.46 / 2.92-3.10 s to 1.23-1.43 / 1.58-1.65 /
2.55-2.62 s; at M = 192..512 the two are within noise, so prefills keep `F.linear`. Other dtypes and
devices keep `F.linear` (bf16 on AVX2 is compute-bound either way; CUDA has its own kernels).

Attention on CUDA leaves out cuDNN's SDPA backend (`attention_backends`): PyTorch prefers it on
Hopper for masked attention, and it builds an execution plan for every new (rows, T, keys) shape.
A decode engine's key length grows by one every step, so nearly every masked forward paid a plan
build: measured on an H100 (docs/gpu-results.md, 2026-11-23), `_cudnn_attention_forward` took
1-6 ms of host time per call, and at batch 32 the dial's standard tier ran at 1,143 tok/s with it
and 3,430 tok/s without it (flash / memory-efficient attention have no per-shape plans).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from server.engine.embedded.model.kv_cache import KVCache

_SMALL_M = (2, 128)  # rows for which `linear` takes the transposed product (see the module doc)
_LARGE_WEIGHT = 1 << 22  # elements; smaller weights gain nothing measurable
# SDPA backends on CUDA: all but cuDNN's, which plans per shape (see the module doc).
_CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device):
    """The context a forward's attention runs in: CUDA without cuDNN attention, else unchanged."""
    return sdpa_kernel(_CUDA_ATTENTION) if device.type == "cuda" else nullcontext()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, `x [..., K]` -> `[..., N]`, as `(W @ x.T).T` for float32 CPU
    products with 2..128 rows and a large weight (see the module doc); equal up to rounding."""
    rows = x.numel() // x.shape[-1]
    if (
        _SMALL_M[0] <= rows <= _SMALL_M[1]
        and weight.numel() >= _LARGE_WEIGHT
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        out = (weight @ x.reshape(rows, -1).t()).t().contiguous()  # [M, N]
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF dict: rope_type/type, factor, ... (None = default)
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @staticmethod
    def from_hf_config(cfg: dict) -> ModelArgs:
        if cfg.get("model_type") not in ("llama", "qwen2", "mistral", None):
            raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} (Llama/Qwen2 family only)")
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; 4.x used rope_theta + rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return ModelArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies `[D/2]` including HF's llama3 long-context rescaling when configured."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [D/2]
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r} (default, linear, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


def rope_table(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """`freqs_cis` `[length, D/2]` complex64: e^{i·pos·inv_freq} for every position."""
    positions = torch.arange(length, dtype=torch.float32, device=inv_freq.device)  # [L]
    angles = torch.outer(positions, inv_freq.float())  # [L, D/2]
    return torch.polar(torch.ones_like(angles), angles)


def interleave_rope_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Permute q/k projection rows from HF's half-split RoPE layout (pairs i, i + D/2) to the
    interleaved layout (pairs 2i, 2i+1), so RoPE is one complex multiply on a view. q and k get
    the same permutation, so every q·k score — hence attention — is unchanged."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()  # [D]
    return w.reshape(heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x `[R, T, H, D]` (interleaved pairs), freqs_cis `[R, T, 1, D/2]` -> rotated `[R, T, H, D]`."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [R, T, H, D/2] complex
    return torch.view_as_real(xc * freqs_cis).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; identical math to HF's in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 as HF does; the scale is applied in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    """One decoder layer with fused q/k/v and gate/up projections (fewer, larger matmuls)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        h, d = args.hidden_size, args.head_dim
        self.q_size, self.kv_size = args.num_heads * d, args.num_kv_heads * d
        self.wqkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.wo = nn.Linear(self.q_size, h, bias=False)
        self.w13 = nn.Linear(h, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, h, bias=False)
        self.attn_norm = RMSNorm(h, args.rms_norm_eps)
        self.mlp_norm = RMSNorm(h, args.rms_norm_eps)

    def forward(self, x, freqs_cis, cache: KVCache, slots, positions, mask, seq_len, contiguous, single):
        r, t, _ = x.shape  # x [R, T, H]
        a = self.args
        qkv = linear(self.attn_norm(x), self.wqkv.weight, self.wqkv.bias)  # [R, T, Hq*D + 2*Hkv*D]
        # RoPE on q and k in one pass: they are adjacent in the fused projection.
        qk = qkv[..., : self.q_size + self.kv_size].view(r, t, a.num_heads + a.num_kv_heads, a.head_dim)
        qk = apply_rope(qk, freqs_cis)  # [R, T, Hq+Hkv, D]
        q = qk[:, :, : a.num_heads].transpose(1, 2)  # [R, Hq, T, D]
        k = qk[:, :, a.num_heads :].transpose(1, 2)  # [R, Hkv, T, D]
        v = qkv[..., self.q_size + self.kv_size :].view(r, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cache.write(self.layer, slots, positions, k, v, single)
        keys, values = cache.read(self.layer, slots, seq_len, contiguous)  # [R, Hkv, S, D] each
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads
        )  # [R, Hq, T, D]
        x = x + linear(out.transpose(1, 2).reshape(r, t, self.q_size), self.wo.weight)
        gate, up = linear(self.mlp_norm(x), self.w13.weight).chunk(2, dim=-1)  # [R, T, I] each
        return x + linear(F.silu(gate) * up, self.w2.weight)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)  # [D/2]
        self.freqs_cis = rope_table(self.inv_freq, 0)  # [L, D/2], grown on demand

    def forward(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        cache: KVCache,
        contiguous: bool | None = None,
    ):
        """tokens `[R, T]`, slots `[R]`, starts `[R]` -> final-norm hidden `[R, T, H]`.

        Writes the new keys/values at positions `starts + [0, T)` of each row's slot; each query
        attends to its row's positions `<= its own`. Callers keep `starts + T <= cache max_seq`.
        `contiguous` (slots == arange(R)) may be passed by callers that know it, saving a check.
        """
        r, t = tokens.shape
        positions = starts.view(-1, 1) + torch.arange(t, device=tokens.device)  # [R, T]
        # One row: its slot and start as Python ints, read once here instead of in every layer.
        single = (int(slots[0]), int(starts[0])) if r == 1 else None
        seq_len = (single[1] if single else int(starts.max())) + t
        if r == 1 and t == 1:
            mask = None  # a single query at the end of its row sees every cached key
        else:
            key_pos = torch.arange(seq_len, device=tokens.device)  # [S]
            mask = (key_pos.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [R, 1, T, S]
        if seq_len > self.freqs_cis.shape[0]:  # rare: tables are sized by `new_cache`
            self.freqs_cis = rope_table(self.inv_freq, max(seq_len, 2 * self.freqs_cis.shape[0]))
            self.freqs_cis = self.freqs_cis.to(tokens.device)
        freqs_cis = self.freqs_cis[positions].unsqueeze(2)  # [R, T, 1, D/2]
        x = F.embedding(tokens, self.embed.weight)  # [R, T, H]
        if contiguous is None:
            contiguous = bool((slots == torch.arange(r, device=slots.device)).all())
        with attention_backends(tokens.device):
            for layer in self.layers:
                x = layer.forward(x, freqs_cis, cache, slots, positions, mask, seq_len, contiguous, single)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> `[..., V]` (float32 for the sampling transforms)."""
        return linear(hidden, self.lm_head.weight).float()

    def new_cache(self, max_batch: int, max_seq: int) -> KVCache:
        from server.engine.embedded.model.kv_cache import CacheShape

        a = self.args
        if self.freqs_cis.shape[0] < max_seq:
            self.freqs_cis = rope_table(self.inv_freq, max_seq).to(self.embed.weight.device)
        shape = CacheShape(a.num_layers, max_batch, a.num_kv_heads, max_seq, a.head_dim)
        return KVCache(shape, self.embed.weight.dtype, self.embed.weight.device)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """Build a `Transformer` from an HF directory (config.json + safetensors), in eval mode."""
    path = Path(path)
    args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
    hf = _read_safetensors(path)
    with torch.device("meta"):
        model = Transformer(args)
    pre = "model.layers"
    state = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    heads = {"q": args.num_heads, "k": args.num_kv_heads}

    def proj(i: int, kind: str, part: str) -> torch.Tensor:  # q/k rows re-ordered for interleaved RoPE
        w = hf[f"{pre}.{i}.self_attn.{kind}_proj.{part}"]
        return interleave_rope_rows(w, heads[kind], args.head_dim) if kind in heads else w

    for i in range(args.num_layers):
        g = lambda name, i=i: hf[f"{pre}.{i}.{name}"]  # noqa: E731

        state[f"layers.{i}.wqkv.weight"] = torch.cat([proj(i, k, "weight") for k in "qkv"])
        if args.qkv_bias:
            state[f"layers.{i}.wqkv.bias"] = torch.cat([proj(i, k, "bias") for k in "qkv"])
        state[f"layers.{i}.wo.weight"] = g("self_attn.o_proj.weight")
        state[f"layers.{i}.w13.weight"] = torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])
        state[f"layers.{i}.w2.weight"] = g("mlp.down_proj.weight")
        state[f"layers.{i}.attn_norm.weight"] = g("input_layernorm.weight")
        state[f"layers.{i}.mlp_norm.weight"] = g("post_attention_layernorm.weight")
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(args)
    model.freqs_cis = rope_table(model.inv_freq, 0)
    return model.to(device).eval().requires_grad_(False)
