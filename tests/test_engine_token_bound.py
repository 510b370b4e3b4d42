"""The byte-length bound that lets the gateway refuse an over-long prompt without tokenizing it:
for byte-level BPE without a normalizer, a text of b UTF-8 bytes has at least ceil(b / L) tokens
(L = `max_token_bytes`). Checked as a property over arbitrary text (with specials and the chat
template) on both shipped tokenizer recipes, and refused for tokenizers where it does not hold."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server.engine.embedded.tokenization import max_token_bytes
from server.engine.model_pair import verify_pair
from server.gateway.prepare import plan
from server.gateway.schemas import CompletionRequest
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine

SPECIALS = ["<|user|>", "<|assistant|>", "<|eos|>", "<|bos|>"]
DENSE = ["the ", "apples ", "    ", "1234567890", "日本語", "✓", "Ünïcödé"]
# Text a tokenizer could pack densely: long repeats, specials, digits, multi-byte characters.
TEXT = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.sampled_from(SPECIALS),
        st.sampled_from(DENSE).map(lambda s: s * 5),
    ),
    max_size=12,
).map("".join)


@pytest.fixture(scope="module", params=["tiny", "embedded"])
def tokenizer(request, tiny_pair):
    path = tiny_pair[0] if request.param == "tiny" else verify_pair().target
    return AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_tokens_are_at_least_bytes_over_the_longest_token(tokenizer, text):
    longest = max_token_bytes(tokenizer)
    assert longest is not None and longest >= 2
    bound = math.ceil(len(text.encode("utf-8")) / longest)
    assert len(tokenizer.encode(text, add_special_tokens=True)) >= bound
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(chat) >= bound


def test_bound_is_refused_when_it_may_not_hold():
    def fast(normalizer=None, model=None, pre=None):
        tok = Tokenizer(model or models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    assert max_token_bytes(fast()) == 2
    assert max_token_bytes(fast(normalizers.NFC())) is None  # may shrink the text first
    drops_spaces = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel()])
    assert max_token_bytes(fast(pre=drops_spaces)) is None
    assert max_token_bytes(fast(model=models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None


def test_over_long_prompt_is_refused_before_tokenizing():
    engine = ScriptedEngine(max_context=64)  # one byte per token: the bound is exact

    def not_here(_):
        raise AssertionError("tokenized")

    engine.encode_prompt = not_here
    body = CompletionRequest(model="scripted-pair", prompt="x" * 64)
    with pytest.raises(Exception) as exc:
        plan("completion", body, engine, GatewaySettings(), max_choices=4)
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"
    assert "at least 64 tokens" in exc.value.message
    assert plan("completion", body.model_copy(update={"prompt": "x" * 63}), engine, GatewaySettings(), 4)
