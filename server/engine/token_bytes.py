"""Each token's own text and UTF-8 bytes, for log-probs (tokens are reported one by one, and a
byte-level BPE token may hold part of a character). Shared by both engines: the embedded engine
renders its rows' tokens, the SGLang client the token ids the runtime reports. No torch import."""

from __future__ import annotations


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1 bytes
    stand for themselves, the other 68 for 256 + their rank."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Each token's own UTF-8 bytes and text (log-probs report tokens one by one, and a token may
    hold part of a character). Byte-level BPE pieces map back through the byte alphabet; added
    tokens (specials) are their text; other tokenizers decode the token alone. Cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = backend.decoder.__class__.__name__ if backend is not None else ""
        self._alphabet = _byte_level_alphabet() if decoder == "ByteLevel" else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """(text, bytes) of one token; text has U+FFFD where its bytes end mid-character."""
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if self._alphabet is not None and token_id not in self._added and piece is not None:
                data = bytes(self._alphabet[ch] for ch in piece)
            else:
                data = self.tok.decode([token_id], clean_up_tokenization_spaces=False).encode("utf-8")
            hit = self._cache[token_id] = (data.decode("utf-8", errors="replace"), tuple(data))
        return hit
