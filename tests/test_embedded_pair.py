"""The shipped embedded pair: integrity, shared tokenizer, sizes, generation, and the card's slice.

Reproduction tolerance (derived): the slice is greedy, fp32, one fixed batch, so on the machine
that wrote the card it is bit-identical. On another CPU, float reductions may order differently;
that can only flip an argmax where the top two logits nearly tie, which is rare on a 20-problem
slice of a confident model. We allow at most 2 of the 20 per-problem outcomes to differ (a 10%
band) and state that bound in the failure message; anything beyond it means the weights, the
tokenizer or the scorer changed.
"""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from server.engine.model_pair import EMBEDDED_PAIR_DIR, PairIntegrityError, verify_pair
from training.scorecard import SLICE_N, load_model, math_slice
from training.spec_reference import measure_acceptance
from training.tasks import load

SLICE_TOLERANCE = 2  # differing per-problem outcomes allowed out of SLICE_N (see module docstring)


@pytest.fixture(scope="module")
def pair():
    return verify_pair()


@pytest.fixture(scope="module")
def loaded(pair):
    tok = AutoTokenizer.from_pretrained(pair.target)
    return tok, load_model(pair.target), load_model(pair.draft)


def test_verify_pair_and_metadata(pair):
    meta = json.loads((EMBEDDED_PAIR_DIR / "pair.json").read_text())
    assert pair.name == meta["name"] == "dialspec-embedded"
    assert meta["num_draft"] == 5
    assert meta["draft_params"] * 5 <= meta["target_params"]
    assert (EMBEDDED_PAIR_DIR / "MODEL_CARD.md").is_file()
    total = sum(p.stat().st_size for p in EMBEDDED_PAIR_DIR.rglob("*") if p.is_file())
    assert total <= 80e6


def test_shared_tokenizer_and_bf16_weights(pair):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (pair.target / name).read_bytes() == (pair.draft / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(pair.draft)
    for role in (pair.target, pair.draft):
        cfg = json.loads((role / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["vocab_size"] == len(tok)
        assert cfg["eos_token_id"] == tok.eos_token_id
    from safetensors import safe_open

    with safe_open(pair.target / "model.safetensors", "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())  # noqa: SIM118
    # digits are split individually; the chat template matches the project's format
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_target_generates_a_finished_answer(loaded):
    tok, target, _ = loaded
    e = load("math", "test", 1)[0]
    ids = tok(
        tok.apply_chat_template(e.messages(), add_generation_prompt=True, tokenize=False),
        return_tensors="pt",
        add_special_tokens=False,
    )
    out = target.generate(**ids, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out[0, -1].item() == tok.eos_token_id
    assert "####" in tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_card_slice_reproduces(loaded):
    tok, target, draft = loaded
    card = json.loads((EMBEDDED_PAIR_DIR / "pair.json").read_text())["slice"]
    for role, model in (("target", target), ("draft", draft)):
        got = math_slice(model, tok)
        diff = sum(a != b for a, b in zip(got, card[role], strict=True))
        assert diff <= SLICE_TOLERANCE, (
            f"{role}: {sum(got)}/{SLICE_N} vs card {sum(card[role])}/{SLICE_N}; "
            f"{diff} outcomes differ (tolerance {SLICE_TOLERANCE})"
        )
    assert sum(card["target"]) > sum(card["draft"])


def test_reference_loop_acceptance_extremes(loaded):
    tok, target, draft = loaded
    prompts = [
        tok(
            tok.apply_chat_template(e.messages(), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for e in load("code", "test", 3)
    ]
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_new_tokens=12)
    # w = 0 verifies against the draft itself: every proposal is accepted.
    assert measure_acceptance(target, draft, prompts, weight=0.0, **kw).rate == 1.0
    # p == q: min(1, p/q) = 1, so a model drafting for itself is always accepted.
    assert measure_acceptance(draft, draft, prompts, **kw).rate == pytest.approx(1.0)
    stats = measure_acceptance(target, draft, prompts, **kw)
    assert 0.0 < stats.rate < 1.0 and stats.emitted > 0


def test_corrupt_or_missing_file_raises(tmp_path):
    copy = tmp_path / "pair"
    shutil.copytree(EMBEDDED_PAIR_DIR, copy)
    verify_pair(copy)
    weights = copy / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PairIntegrityError, match=r"draft/model.safetensors is corrupt.*dialspec pair train"):
        verify_pair(copy)
    weights.unlink()
    with pytest.raises(PairIntegrityError, match=r"draft/model.safetensors is missing.*git checkout models/"):
        verify_pair(copy)
    (copy / "SHA256SUMS").unlink()
    with pytest.raises(PairIntegrityError, match="no SHA256SUMS"):
        verify_pair(copy)


def test_shipped_prompts_are_the_task_suite_test_split():
    """`models/embedded/prompts.jsonl` (what benchmarks and load tests read without importing
    training) is exactly what `dialspec pair prompts` generates from the task suite."""
    from server.engine.model_pair import PROMPTS_FILE, suite_prompts
    from training.pair_cli import suite_prompt_lines

    shipped = (EMBEDDED_PAIR_DIR / PROMPTS_FILE).read_text(encoding="utf-8").splitlines()
    assert shipped == suite_prompt_lines()
    assert suite_prompts(3) == [load(t, "test", 1)[0].prompt for t in ("code", "math", "summary")]
