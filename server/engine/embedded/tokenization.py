"""The pair's tokenizer as the engine uses it: its stop ids, chat messages to prompt ids, and the
bytes-per-token bound (`max_token_bytes`) that lets the gateway refuse an over-long prompt
without tokenizing it (EngineInfo.max_token_bytes, gateway/prepare.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from server.engine.protocol import EngineError


def stop_ids(tokenizer, model_config: dict) -> frozenset[int]:
    """The EOS ids: the target's `config.json` `eos_token_id` (one id or a list) and the tokenizer's."""
    eos = model_config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def encode_chat(tokenizer, messages: Sequence[dict[str, str]], model: str) -> list[int]:
    """`messages` through the chat template, with the assistant's turn opened; a template error
    (bad roles, missing keys) or a model without a template is the caller's EngineError."""
    if not getattr(tokenizer, "chat_template", None):
        msg = f"model {model!r} has no chat template; send a plain prompt"
        raise EngineError(msg, "invalid_request")
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:
        raise EngineError(f"chat template failed: {exc}", "invalid_request") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _keeps_bytes(pre_tokenizer: dict) -> bool:
    """Pre-tokenizers that only split (or add a prefix space): every input byte reaches the model."""
    kind = pre_tokenizer.get("type")
    if kind in ("ByteLevel", "Digits"):
        return True
    return kind in ("Split", "Punctuation") and pre_tokenizer.get("behavior") != "Removed"


def max_token_bytes(tokenizer) -> int | None:
    """The longest token in UTF-8 bytes when that bounds the token count from below, else None.

    For byte-level BPE without a normalizer, tokenizing text splits its UTF-8 bytes into pieces
    that are each a vocabulary entry (or an added token matched verbatim), and special tokens
    added around it only add to the count. So any text of b bytes gives at least
    ceil(b / L) tokens, L = the longest entry in bytes. A normalizer (NFC, lowercasing, ...) may
    shrink the text first, and other models (WordPiece, Unigram) may drop bytes: no bound then.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in parts) or not all(map(_keeps_bytes, parts)):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = set(ByteLevel.alphabet())  # each of these 256 characters stands for one byte

    def size(piece: str) -> int:
        return sum(1 if ch in alphabet else len(ch.encode("utf-8")) for ch in piece)

    vocab = spec["model"].get("vocab") or {}
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    return max([size(t) for t in vocab] + [len(a.encode("utf-8")) for a in added] + [1])
