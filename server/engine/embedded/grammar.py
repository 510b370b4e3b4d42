"""Constrained decoding (`response_format`): a grammar per row, a token mask per position.

The mask m_t (the tokens the grammar allows after the accepted prefix and the drafts before t) is
applied to the logits of *both* models before the sampling transform, so p̃ = p·m/Σp·m and
q̃ = q·m/Σq·m are the constrained models and ν̃ = w·p̃ + (1−w)·q̃ their ensemble (/work/shared
DESIGN, "Constraints and the dial"): every identity of the verifier holds with tildes, w = 1 samples
the constrained target exactly, w = 0 the constrained draft, and no token the grammar forbids can be
drafted, accepted, corrected or drawn as a bonus. Masking the logits first (not the probabilities
after top-k/top-p) keeps p̃ and q̃ defined however the transform truncates: the allowed tokens are
ranked among themselves.

A round (`round.py`): each draft is drawn from q̃ in the state it is generated in, and the matcher
accepts it speculatively (`RowGrammar.accept`); the target scores position t with that position's
mask; after the verdict the matcher keeps the k accepted drafts, rolls back the rest and accepts the
correction or bonus (`RowGrammar.settle`). Once the grammar is complete only its stop tokens (EOS)
are allowed, and a constrained row always stops at EOS (`ignore_eos` does not apply to it).

Schemas compile once each (xgrammar's compiler caches by schema), off the event loop with a time
limit (`EngineGrammars.compile`, awaited by `EmbeddedEngine.generate`). JSON is compact (no free
whitespace: a model cannot wander in it), `json_object` is any JSON object.

Cost: per constrained row and position, one bitmask fill on the host and its unpacking to a `[V]`
mask, summed in the scheduler's timers (`grammar_s`; `dialspec bench engine --response-format`
reports it per round).
"""

from __future__ import annotations

import asyncio
import codecs
import importlib.util
import threading
import time

import torch

from server.engine.protocol import EngineError, ResponseFormat
from server.engine.token_bytes import TokenBytes

_SHIFTS = torch.arange(32, dtype=torch.int32)
# UTF-8 lead bytes whose next byte has a narrower range than 80-BF (RFC 3629, section 4)
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _clean(data: bytes) -> bool:
    """No control byte, and valid UTF-8 inside: continuation bytes may open it (they continue the
    previous token's character) and a sequence may be cut at its end (the next token ends it)."""
    if any(b < 0x20 for b in data):
        return False
    start = 0
    while start < len(data) and 0x80 <= data[start] <= 0xBF:
        start += 1
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data[start:], final=False)
    except UnicodeDecodeError:
        return False
    return True


class GrammarError(ValueError):
    """A schema xgrammar cannot compile (the message names what)."""


class GrammarCache:
    """The pair's tokenizer as xgrammar sees it, and a compiler whose cache holds each schema once."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        # Where xgrammar is laxer than JSON, on byte-level vocabularies: its strings admit raw
        # control characters (all but CR and LF), which JSON forbids and strict parsers (pydantic's,
        # Python's json) refuse, and UTF-8 it cannot have produced (overlong forms, surrogates, past
        # U+10FFFF: it checks the number of continuation bytes, not their range). So tokens with a
        # byte below 0x20 or an invalid sequence inside are never allowed (`clean`), and after a
        # token that ends on a lead byte whose next byte has a narrower range (E0, ED, F0, F4), only
        # tokens starting inside that range are (`_SECOND_BYTE`, `RowGrammar.tail`).
        token_bytes = TokenBytes(tokenizer)
        self.clean = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self.ends_on = {}  # token id -> the lead byte it ends on, for the leads above
        first = torch.full((vocab_size,), -1, dtype=torch.long)  # [V] each token's first byte
        for token_id in range(min(vocab_size, len(tokenizer))):
            data = bytes(token_bytes(token_id)[1])
            self.clean[token_id] = _clean(data)
            if data:
                first[token_id] = data[0]
                if data[-1] in _SECOND_BYTE:
                    self.ends_on[token_id] = data[-1]
        self.clean[self.stop_ids] = True
        self.second_byte = {lead: (first >= lo) & (first <= hi) for lead, (lo, hi) in _SECOND_BYTE.items()}
        self.timers = None  # the scheduler's `StepTimers`, which sum the masks' host time

    def compile(self, fmt: ResponseFormat):
        """The compiled grammar for `fmt` (cached); GrammarError on a schema it cannot compile."""
        # json_object: any object (strict mode would close it to no properties at all)
        schema, strict = ('{"type": "object"}', False) if fmt.kind == "json_object" else (fmt.schema, True)
        try:
            return self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        except (RuntimeError, ValueError) as exc:
            why = str(exc).strip().splitlines()[-1]
            raise GrammarError(f"response_format: the schema cannot be compiled: {why}") from None

    def row(self, fmt: ResponseFormat) -> RowGrammar:
        return RowGrammar(self, self.compile(fmt))


class RowGrammar:
    """One row's grammar state: the accepted prefix plus this round's speculative drafts."""

    def __init__(self, cache: GrammarCache, compiled):
        import xgrammar as xgr

        self.cache = cache
        self.matcher = xgr.GrammarMatcher(compiled)  # rolls back any number of tokens
        self.bitmask = xgr.allocate_token_bitmask(1, cache.vocab_size)  # [1, ceil(V/32)] int32
        self.tail: int | None = None  # the lead byte the accepted text ends on (E0, ED, F0, F4)
        self.window: list[int | None] = []  # `tail` before each draft accepted since `settle`

    def allowed(self) -> torch.Tensor:
        """`[V]` bool: the tokens allowed next (only the stop tokens once the grammar has ended)."""
        t0 = time.perf_counter()
        if self.matcher.is_terminated():
            out = torch.zeros(self.cache.vocab_size, dtype=torch.bool)
            out[self.cache.stop_ids] = True
        else:
            self.matcher.fill_next_token_bitmask(self.bitmask, 0)
            bits = (self.bitmask[0].unsqueeze(-1) >> _SHIFTS) & 1  # [W, 32]
            out = bits.bool().view(-1)[: self.cache.vocab_size] & self.cache.clean
            if self.tail is not None:
                out &= self.cache.second_byte[self.tail]
        timers = self.cache.timers
        if timers is not None:
            timers.grammar_s += time.perf_counter() - t0
            timers.grammar_masks += 1
        return out

    def accept(self, token: int) -> None:
        """A draft drawn under `allowed()` (a no-op past the end: the row stops at its EOS)."""
        if not self.matcher.is_terminated():
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"grammar refused token {token} drawn under its own mask")
            self.window.append(self.tail)
            self.tail = self.cache.ends_on.get(token)

    def settle(self, kept: int, final: int | None) -> None:
        """After a round's verdict: keep `kept` drafts, roll back the others, then take `final`
        (the correction or bonus; None in draft-only rounds, whose drafts are all kept)."""
        taken = len(self.window)
        undo = taken - min(kept, taken)
        if undo:
            self.matcher.rollback(undo)
            self.tail = self.window[taken - undo]
        self.window.clear()
        if final is not None:
            self.accept(final)
            self.window.clear()


def mask_logits(logits: torch.Tensor, idx: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """`logits` `[R, ..., V]` with rows `idx` limited to `allowed` `[len(idx), ..., V]` (others
    untouched; a new tensor)."""
    at = torch.tensor(idx, device=logits.device)
    out = logits.clone()
    out[at] = logits[at].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


def constrained(rows) -> list[int]:
    """Indices of the rows with a grammar."""
    return [i for i, row in enumerate(rows) if row.grammar is not None]


def allowed_now(rows, idx: list[int]) -> torch.Tensor:
    """`[len(idx), V]` bool: each constrained row's mask in its current state."""
    return torch.stack([rows[i].grammar.allowed() for i in idx])


def xgrammar_installed() -> bool:
    """xgrammar is installed (the `structured` extra)."""
    return importlib.util.find_spec("xgrammar") is not None


class EngineGrammars:
    """An engine's one `GrammarCache`, built on first use (it reads the whole vocabulary), and the
    time-limited compile a constrained request waits for before its row is made (the row then
    finds the schema in the compiler's cache)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, timeout_s: float):
        self._args = (tokenizer, vocab_size, stop_ids)
        self.timeout_s = timeout_s
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()  # the scheduler thread and compile threads both build it

    def cache(self, timers=None) -> GrammarCache:
        """The cache; `timers` (the running scheduler's) then sum its masks' host time."""
        with self._lock:
            if self._cache is None:
                self._cache = GrammarCache(*self._args)
            if timers is not None:
                self._cache.timers = timers
            return self._cache

    async def compile(self, fmt: ResponseFormat, timers=None) -> None:
        """Compile `fmt` off the event loop within `timeout_s`; EngineError 'invalid_request' when
        it does not compile or takes longer (xgrammar cannot be interrupted: it finishes unseen)."""
        work = asyncio.to_thread(lambda: self.cache(timers).compile(fmt))  # the first builds the cache too
        try:
            await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            msg = f"response_format: the schema did not compile within {self.timeout_s:g} s; simplify it"
            raise EngineError(msg, "invalid_request") from None
        except GrammarError as exc:
            raise EngineError(str(exc), "invalid_request") from None
