"""`dialspec pair synth`: random-weight checkpoints with the exact shapes of public model pairs.

Speed is a property of shapes, not of weight values, so a pair with Qwen2.5-0.5B → 1.5B shapes
measures what serving that pair costs here, without downloading anything. Acceptance on random
weights is whatever two unrelated random models agree on; benchmarks report it and use w = 0 for
the all-accepted case.

Layout written (both directories are ordinary HF checkpoints: the engine and
`AutoModelForCausalLM` load them):

    OUT/target/  config.json, model-0000K.safetensors shards + index, tokenizer files
    OUT/draft/   same, same tokenizer
    OUT/pair.json

Tokenizer: the embedded pair's byte-level BPE (chat template and specials unchanged) with its
vocabulary padded to the models' size by tokens `<t123456>` that no merge produces: every id
decodes (to its own name), every text encodes (with the base vocabulary), and prompts look like
the embedded pair's. Chosen over a generated 152k-merge BPE because it keeps the benchmark's
prompts and chat format identical across pairs.

Weights: N(0, 0.02) matrices (HF's `initializer_range`), unit norms, zero biases; each tensor
seeded from (seed, name), so the output is deterministic and independent of write order.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from server.engine.model_pair import EMBEDDED_PAIR_DIR


@dataclass(frozen=True)
class Shape:
    """The fields of an HF config that fix a decoder's cost."""

    model_type: str  # "qwen2" (q/k/v biases) or "llama"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    head_dim: int | None = None
    rope_scaling: dict | None = None

    def num_params(self) -> int:
        h, i, d = (
            self.hidden_size,
            self.intermediate_size,
            self.head_dim or self.hidden_size // self.num_attention_heads,
        )
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        layer = (
            h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + (q + 2 * kv if self.model_type == "qwen2" else 0)
        )
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h


# From the public config.json files of these models (sizes only; nothing is downloaded).
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, True, 1e6, 1e-6),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 1e6, 1e-6),
    "llama3.2-1b": Shape(
        "llama", 2048, 8192, 16, 32, 8, 128256, True, 5e5, 1e-5, 64,
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
    "llama3.1-8b": Shape(
        "llama", 4096, 14336, 32, 32, 8, 128256, False, 5e5, 1e-5, 128,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip
PAIRS = {  # name -> (draft, target)
    "qwen2.5-0.5b-1.5b": ("qwen2.5-0.5b", "qwen2.5-1.5b"),
    "llama3-1b-8b": ("llama3.2-1b", "llama3.1-8b"),
}
_SHARD_BYTES = 1 << 30  # ~1 GiB shards keep peak memory near one shard while writing


def _config(shape: Shape, tokenizer) -> dict:
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[shape.model_type]
    rope = {"rope_theta": shape.rope_theta, "rope_type": "default", **(shape.rope_scaling or {})}
    cfg = {
        "architectures": [arch],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "bfloat16",
        "use_cache": True,
    }
    if shape.head_dim:
        cfg["head_dim"] = shape.head_dim
    if shape.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers)
    return cfg


def _tensor_specs(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init) for every parameter, in checkpoint order."""
    h, i = shape.hidden_size, shape.intermediate_size
    d = shape.head_dim or h // shape.num_attention_heads
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    specs = [("model.embed_tokens.weight", (shape.vocab_size, h), "normal")]
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}"
        specs += [(f"{p}.input_layernorm.weight", (h,), "ones")]
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            specs.append((f"{p}.self_attn.{name}_proj.weight", (rows, h), "normal"))
            if shape.model_type == "qwen2":
                specs.append((f"{p}.self_attn.{name}_proj.bias", (rows,), "zeros"))
        specs += [
            (f"{p}.self_attn.o_proj.weight", (h, q), "normal"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
            (f"{p}.mlp.gate_proj.weight", (i, h), "normal"),
            (f"{p}.mlp.up_proj.weight", (i, h), "normal"),
            (f"{p}.mlp.down_proj.weight", (h, i), "normal"),
        ]
    specs.append(("model.norm.weight", (h,), "ones"))
    if not shape.tie_word_embeddings:
        specs.append(("lm_head.weight", (shape.vocab_size, h), "normal"))
    return specs


def _make(name: str, dims: tuple[int, ...], init: str, seed: int, device: str) -> torch.Tensor:
    if init == "ones":
        return torch.ones(dims, dtype=torch.bfloat16)
    if init == "zeros":
        return torch.zeros(dims, dtype=torch.bfloat16)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    gen = torch.Generator(device=device).manual_seed(key)
    out = torch.empty(dims, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
    return out.to(torch.bfloat16).cpu()


def write_model(out: Path, shape: Shape, tokenizer, seed: int, device: str = "cpu", progress=None) -> Path:
    """One HF checkpoint directory (bf16 shards + index + config + tokenizer)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    specs = _tensor_specs(shape)
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = 2 * int(torch.Size(spec[1]).numel())
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _make(name, dims, init, seed, device) for name, dims, init in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        if progress:
            progress(len(tensors))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(_config(shape, tokenizer), indent=2) + "\n")
    tokenizer.save_pretrained(out)
    # AutoTokenizer loads qwen2 checkpoints with Qwen2Tokenizer, whose default unk token
    # <|endoftext|> would be added past the models' vocabulary: say there is none.
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["unk_token"] = None
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def padded_tokenizer(vocab_size: int, source: Path = EMBEDDED_PAIR_DIR / "target"):
    """The embedded pair's tokenizer with its vocabulary padded to `vocab_size` ids (see module doc)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base = AutoTokenizer.from_pretrained(str(source))
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<t{i}>"] = i  # printable ASCII: the byte-level decoder maps it to itself
    extra = [t["content"] for t in spec["added_tokens"]]
    extra = [t for t in extra if t not in (base.bos_token, base.eos_token, base.pad_token)]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        additional_special_tokens=extra,
    )
    fast.chat_template = base.chat_template
    if len(fast) != vocab_size:
        raise ValueError(f"padded tokenizer has {len(fast)} ids, models have {vocab_size}")
    return fast


def write_pair(out: Path, pair: str, seed: int = 0, device: str = "cpu", progress=None) -> dict:
    """Write `out/target`, `out/draft` and `out/pair.json` for a `PAIRS` entry; returns the meta."""
    draft_name, target_name = PAIRS[pair]
    draft_shape, target_shape = SHAPES[draft_name], SHAPES[target_name]
    if draft_shape.vocab_size != target_shape.vocab_size:
        raise ValueError(f"{pair}: draft and target vocabularies differ")
    out = Path(out)
    t0 = time.perf_counter()
    tok = padded_tokenizer(target_shape.vocab_size)
    for sub, shape, offset in (("target", target_shape, 0), ("draft", draft_shape, 1)):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
        write_model(out / sub, shape, tok, seed + offset, device, progress)
    meta = {
        "name": f"synthetic-{pair}",
        "pair": pair,
        "shapes": {"target": target_name, "draft": draft_name},
        "target_params": target_shape.num_params(),
        "draft_params": draft_shape.num_params(),
        "seed": seed,
        "weights": "random N(0, 0.02), bf16: speed only, no language",
        "tokenizer": "embedded pair's BPE padded with <tN> tokens to the models' vocabulary",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "pair.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def num_tensors(pair: str) -> int:
    draft_name, target_name = PAIRS[pair]
    return len(_tensor_specs(SHAPES[draft_name])) + len(_tensor_specs(SHAPES[target_name]))
