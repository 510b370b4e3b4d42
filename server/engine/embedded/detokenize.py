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
