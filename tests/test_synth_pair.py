"""`dialspec pair synth`: random-weight checkpoints with public shapes, loadable by the engine and HF.

The real-size pairs are never built here (gigabytes); tiny shapes go through the same writer.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.cli import main
from server.engine.embedded.model.llama import load_model
from training import synth_pair
from training.synth_pair import SHAPES, Shape, write_pair

TINY = {
    "tiny-qwen-draft": Shape("qwen2", 32, 64, 1, 2, 1, 1200, True, 1e6, 1e-6),
    "tiny-qwen-target": Shape("qwen2", 64, 128, 2, 4, 2, 1200, True, 1e6, 1e-6),
    "tiny-llama-target": Shape(
        "llama", 64, 96, 2, 4, 2, 1200, False, 5e5, 1e-5, 16,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ),
}  # fmt: skip


@pytest.fixture()
def tiny_shapes(monkeypatch):
    monkeypatch.setattr(synth_pair, "SHAPES", {**SHAPES, **TINY})
    monkeypatch.setattr(
        synth_pair,
        "PAIRS",
        {
            "tiny-qwen": ("tiny-qwen-draft", "tiny-qwen-target"),
            "tiny-mixed": ("tiny-qwen-draft", "tiny-llama-target"),
        },
    )


def test_public_shapes_have_the_public_parameter_counts():
    assert SHAPES["qwen2.5-1.5b"].num_params() == 1_543_714_304
    assert SHAPES["qwen2.5-0.5b"].num_params() == 494_032_768
    assert abs(SHAPES["llama3.1-8b"].num_params() - 8.03e9) < 0.01e9
    assert abs(SHAPES["llama3.2-1b"].num_params() - 1.24e9) < 0.01e9


@pytest.mark.parametrize("pair", ["tiny-qwen", "tiny-mixed"])
def test_written_pair_loads_in_the_engine_and_hf_alike(tiny_shapes, tmp_path, pair):
    meta = write_pair(tmp_path, pair, seed=3)
    target_dir = tmp_path / "target"
    n = sum(t.numel() for f in target_dir.glob("*.safetensors") for t in load_file(str(f)).values())
    assert n == meta["target_params"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    chat = [{"role": "user", "content": "Tom has 7 apples"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ours = load_model(target_dir, "cpu", torch.float32)
    cache = ours.new_cache(1, 64)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
        got = ours.logits(ours(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), cache))[0]
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_tokenizer_decodes_every_id_and_keeps_the_chat_format(tiny_shapes, tmp_path):
    write_pair(tmp_path, "tiny-qwen")
    tok = AutoTokenizer.from_pretrained(tmp_path / "target")
    assert len(tok) == 1200
    text = tok.decode(list(range(1200)))
    assert "<t1199>" in text
    sample = "Tom has 12 apples. ü ✓"
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    embedded = AutoTokenizer.from_pretrained(synth_pair.EMBEDDED_PAIR_DIR / "target")
    assert tok.encode(sample, add_special_tokens=False) == embedded.encode(sample, add_special_tokens=False)


def test_same_seed_same_bytes(tiny_shapes, tmp_path):
    def digest(root):
        files = [f for sub in ("target", "draft") for f in sorted((root / sub).glob("*.safetensors"))]
        return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()

    write_pair(tmp_path / "a", "tiny-qwen", seed=1)
    write_pair(tmp_path / "b", "tiny-qwen", seed=1)
    write_pair(tmp_path / "c", "tiny-qwen", seed=2)
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")
    assert json.loads((tmp_path / "a" / "pair.json").read_text())["shapes"]["target"] == "tiny-qwen-target"


def test_cli_refuses_unknown_shapes_and_foreign_directories(tmp_path, capsys):
    assert main(["pair", "synth", "--out", str(tmp_path / "x"), "--shape", "gpt5"]) == 2
    assert "unknown --shape" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["pair", "synth", "--out", str(tmp_path / "busy")]) == 2
    assert "not a synthetic pair" in capsys.readouterr().err
