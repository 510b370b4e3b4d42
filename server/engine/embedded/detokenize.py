"""Incremental detokenization and stop-string handling for streamed output.

Terms
    delta       new text for the tokens appended since the last call.
    prefix/read offsets (vLLM's scheme): text is decoded from a short window of tokens
                `ids[prefix:]` and compared with `ids[prefix:read]`, so tokenizers whose pieces
                depend on their left neighbour (sentencepiece spaces) decode correctly without
                re-decoding the whole sequence each step.
    held back   a byte-level BPE token can end in the middle of a multi-byte UTF-8 character;
                the decoder then yields U+FFFD, and we wait for the next token instead of emitting it.
    stop hold   text that could still be the start of a stop string is not streamed until the
                next tokens decide it; the final text never includes the stop string itself.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens kept as left context for the first decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end of generation (an incomplete char decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :]


class StopStringFilter:
    """Streams text while withholding anything that might begin a stop string.

    `feed(delta)` returns `(text_to_emit, stopped)`. After `stopped` is True the stream is over
    and the emitted text ends right before the stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything decoded so far
        self.sent = 0  # chars of `text` already emitted

    def feed(self, delta: str) -> tuple[str, bool]:
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, False
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.sent - longest + 1)
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            cut = min(hits)
            out = self.text[self.sent : cut] if cut > self.sent else ""
            self.sent = len(self.text)
            return out, True
        safe = len(self.text)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self.sent)
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        """At a non-stop finish, release the held-back tail."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


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
