"""Per-request decoding state (one batch row) and how accepted tokens turn into stream chunks.

Terms
    seq     prompt + generated token ids so far.
    tlen    target cache length: positions of `seq` whose keys/values the target holds. Always
            `len(seq) - 1` between steps: the last token is the *pending* input of the next verify
            (0 for `draft_only` rows: the target never runs for them).
    dlen    draft cache length; between steps `len(seq) - dlen` (the draft's lag) is 1, 2 when
            every draft of the last round was accepted without a bonus step (the draft had not
            consumed its own last proposal), or more after rounds without drafts.
    num_draft  N for this row's next round; 0 means no drafts.
    mode    how the row decodes (`RowMode`), fixed at admission.
    sink    callable receiving each `GenerationChunk`, or an `Exception` that ends the stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from server.engine.embedded.detokenize import IncrementalDetokenizer, StopStringFilter
from server.engine.embedded.grammar import RowGrammar
from server.engine.embedded.planner.acceptance import AcceptanceEstimate
from server.engine.protocol import GenerationChunk, GenerationRequest, SpecStats, TokenLogprob, TokenTrace
from server.engine.token_bytes import TokenBytes
from verifier import Policy, PolicyKind
from verifier.dial import Verification


@dataclass(frozen=True)
class RowMode:
    """How a request decodes, decided once at admission (`RowMode.of`, from `make_row`).

    adaptive     N is chosen each round by the planner (`planner/`); else `num_draft` is fixed (a
                 per-request or engine-wide N, or 0 for autoregressive rows).
    speculative  the draft may run for this row (adaptive, or a fixed N > 0).
    uses_head    the learned head sets w_t. A learned row whose head pins w = 1 at the top of its
                 dial (`HeadConfig.exact_at_full_dial`, d >= 1) is a static w = 1 row instead.
    needs_q      ν ≠ p somewhere: an ensemble row with w < 1 (or a head) that may speculate.
    draws_nu     the tokens no draft proposed (an N = 0 round's token, the bonus after N accepted
                 drafts, the first token from the prefill) are drawn from ν. That needs the draft's
                 q there, one more draft step, and buys no token: the same token drawn from p is
                 free and of the higher-quality law. So only rows that must follow ν exactly draw
                 from it (`needs_q` and strict: a fixed N, or the engine's `--strict-nu`); an
                 adaptive w < 1 row otherwise draws those tokens from p, and its rounds cost what
                 a w = 1 row's cost: a lower quality is never slower (docs/algorithm.md).
    draft_only   quality 0 (a static w = 0): ν = q, so the target is never needed; the row decodes
                 from the draft alone (`draft_only.py`). Only adaptive rows the engine may
                 schedule freely; a pinned N (per request, engine-wide, a bench's sweep) keeps
                 the speculative path.
    eager_draft  the prefill feeds the prompt to the draft (it will surely run); other rows feed
                 it when they first draft.
    reproducible an adaptive row whose output must not depend on the load: a seed was given, or
                 greedy (whose bonus, from p or ν, also depends on N). The planner chooses its N
                 from its own history and the start-up cost profile alone
                 (`planner/draft_planner.py`), so the same request gives the same tokens in any
                 batch under any load. Fixed-N rows are reproducible by construction.
    """

    adaptive: bool = False
    speculative: bool = False
    uses_head: bool = False
    needs_q: bool = False
    draws_nu: bool = False
    draft_only: bool = False
    eager_draft: bool = False
    reproducible: bool = False

    @classmethod
    def of(
        cls,
        v: Verification,
        fixed: int | None,
        *,
        strict_nu: bool = True,
        allow_draft_only: bool = False,
        head_exact_at_top: bool = False,
        reproducible: bool = False,
    ) -> RowMode:
        """`fixed`: the row's N, None for adaptive. `strict_nu`: adaptive rows draw from ν too.
        `reproducible`: seeded or greedy (kept for adaptive rows only)."""
        adaptive = fixed is None
        speculative = adaptive or fixed > 0
        uses_head = v.learned and not (head_exact_at_top and v.dial >= 1.0)
        ensemble = v.policy == PolicyKind.ENSEMBLE
        needs_q = speculative and ensemble and (uses_head or (not v.learned and v.weight < 1.0))
        draws_nu = needs_q and (strict_nu or not adaptive)
        draft_only = allow_draft_only and adaptive and ensemble and not v.learned and v.weight == 0.0
        eager_draft = draft_only or draws_nu or (not adaptive and speculative)
        reproducible = reproducible and adaptive
        return cls(adaptive, speculative, uses_head, needs_q, draws_nu, draft_only, eager_draft, reproducible)


@dataclass(eq=False)
class Row:
    request: GenerationRequest
    sink: Callable[[object], None]
    num_draft: int
    tokenizer: object
    eos_ids: frozenset[int]
    mode: RowMode | None = None  # None: a fixed N = `num_draft`, strict ν (direct callers, tests)
    slot: int = -1
    seq: list[int] = field(default_factory=list)
    tlen: int = 0
    dlen: int = 0
    completion: int = 0
    cancelled: bool = False
    done: bool = False
    stats: SpecStats = field(default_factory=SpecStats)
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    rounds: int = 0  # rounds this row has advanced in (the scheduler's fault-isolation mark)
    token_bytes: TokenBytes | None = None  # renders tokens for log-probs (the engine shares one)
    grammar: RowGrammar | None = None  # the `response_format` constraint's state (`grammar.py`)

    def __post_init__(self):
        s, v = self.request.sampling, self.request.verify
        if self.mode is None:
            self.mode = RowMode.of(v, self.num_draft)
        self.seq = list(self.request.prompt_token_ids)
        self.prompt_len = len(self.seq)
        self.greedy = s.temperature <= 0
        # Greedy rows are verified on temperature-1 probabilities (argmax is taken over real p, q).
        self.temperature = 1.0 if self.greedy else float(s.temperature)
        self.top_k = 0 if self.greedy else int(s.top_k)
        self.top_p = 1.0 if self.greedy else float(s.top_p)
        self.learned = v.learned
        # static w; a learned row whose head is pinned at the top of its dial is a w = 1 row
        self.weight = 1.0 if self.learned and not self.mode.uses_head else float(v.weight)
        self.dial = v.dial  # the learned head's input, None for static rows
        self.policy = Policy.of(v)
        ends = frozenset() if _ignore_eos(s) and self.grammar is None else self.eos_ids  # a grammar's end
        self.stop_ids = frozenset(s.stop_token_ids) | ends
        seed = s.seed if s.seed is not None else random.SystemRandom().getrandbits(63)
        # Each row owns its random stream, so its draws do not depend on who shares the batch.
        self.generator = torch.Generator().manual_seed(int(seed))
        self.detok = IncrementalDetokenizer(self.tokenizer, self.seq)
        if self.request.logprobs is not None and self.token_bytes is None:
            self.token_bytes = TokenBytes(self.tokenizer)
        self.stopper = StopStringFilter(s.stop)
        self.stats.accepted_per_position = [0] * self.num_draft
        # The latest round as `_provenance` reads it: (k, w per position, N, bonus drawn from ν).
        self.last_round: tuple[int, list[float], int, bool] = (0, [], 0, False)

    def uniforms(self, count: int) -> torch.Tensor:
        """Next `count` uniforms `[count]` of this row's stream (drawn on CPU for determinism)."""
        return torch.rand(count, generator=self.generator)

    @property
    def draft_lag(self) -> int:
        return len(self.seq) - self.dlen if self.mode.speculative else 0

    @property
    def tokens_left(self) -> int:
        return self.request.sampling.max_tokens - self.completion

    @property
    def prior_weight(self) -> float:
        """w for the acceptance prior: the learned rows' mean w_t so far, else the static w."""
        mean = self.stats.mean_weight if self.learned else None
        return self.weight if mean is None else mean

    def record_round(self, num_accepted: int, weights: list[float], n: int, bonus_from_nu=False) -> None:
        """A round of N = `n` drafts: k accepted, `weights` the w per tested position (plus the
        bonus's w when `bonus_from_nu`: the bonus, or at N = 0 the token, was drawn from ν)."""
        self.last_round = (num_accepted, weights, n, bonus_from_nu)
        self.rounds += 1
        st = self.stats
        st.verify_steps += 1
        if not n and self.mode.needs_q and not bonus_from_nu:
            st.target_only_rounds += 1
        if n:
            st.drafts += 1
            st.draft_tokens += n
            st.accepted_tokens += num_accepted
            if len(st.accepted_per_position) < n:
                st.accepted_per_position += [0] * (n - len(st.accepted_per_position))
            for i in range(num_accepted):
                st.accepted_per_position[i] += 1
            st.weight_sum += float(sum(weights))
            st.weight_count += len(weights)

    def record_draft_only(self, n: int) -> None:
        """A draft-only round of `n` tokens drawn from q = ν (w = 0); traced as drafts with w = 0.
        (`emit_tokens(..., draft_only=True)` counts the ones kept: a stop may end it sooner.)"""
        self.last_round = (n, [0.0] * n, n, False)
        self.rounds += 1
        self.stats.weight_count += n  # w = 0 at each (weight_sum unchanged): mean w reads 0

    def emit_tokens(self, tokens: list[int], logprobs: list | None = None, draft_only: bool = False) -> None:
        """Append one round's tokens in order (its k accepted drafts, then the correction or bonus;
        `record_round` has just been told k), applying stop rules; sends one chunk to the sink.
        `logprobs`: one `logprobs.RawLogprob` per token, for rows that asked. `draft_only`: a
        draft-only round's tokens, counted in `draft_only_tokens` as kept (a stop may end it)."""
        max_tokens = self.request.sampling.max_tokens
        pieces, emitted, finish = [], [], None  # pieces[i]: the text released with emitted[i]
        for tok in tokens:
            self.seq.append(tok)
            self.completion += 1
            emitted.append(tok)
            if tok in self.stop_ids:
                finish = "stop"
                pieces.append("")
                break
            out, stopped = self.stopper.feed(self.detok.push(tok))
            pieces.append(out)
            if stopped:
                finish = "stop"
                break
            if self.completion >= max_tokens:
                finish = "length"
                break
        if finish == "length" or (finish == "stop" and emitted[-1] in self.stop_ids):
            # Not ended by a stop string: release any held-back text (and incomplete bytes).
            pieces[-1] += self.stopper.feed(self.detok.flush())[0] + self.stopper.flush()
        if draft_only:
            self.stats.draft_only_tokens += len(emitted)
        chunk = GenerationChunk("".join(pieces), emitted, self.prompt_len, self.completion, finish)
        if self.request.trace:
            chunk.provenance = self._provenance(pieces)
        if logprobs is not None:
            chunk.logprobs = [
                self._logprob(tok, raw) for tok, raw in zip(emitted, logprobs[: len(emitted)], strict=True)
            ]
        self.send(chunk)
        if finish is not None:
            self.done = True

    def _provenance(self, pieces: list[str]) -> list[TokenTrace]:
        """Token i of a round: a draft while i < k, then a correction (k < N) or the bonus (k = N).
        At N = 0 the token is the target's own (drawn from p), or a bonus when drawn from ν."""
        k, weights, n, from_nu = self.last_round
        ensemble = self.policy.kind == PolicyKind.ENSEMBLE
        out = []
        for i, text in enumerate(pieces):
            if n == 0 and not from_nu:
                source = "target"
            elif i < k:
                source = "draft"
            else:
                source = "corrected" if k < n else "bonus"
            if not ensemble or source == "target":
                weight = None
            elif source == "bonus":  # from ν (round.bonus) with its w, else from p: ν at w = 1
                weight = float(weights[i]) if from_nu else 1.0
            else:
                weight = float(weights[i])
            out.append(TokenTrace(source, text, weight, i, n))
        return out

    def _logprob(self, token_id: int, raw) -> TokenLogprob:
        top = tuple(TokenLogprob(*self.token_bytes(t), lp) for t, lp in raw.top)
        return TokenLogprob(*self.token_bytes(token_id), raw.logprob, top)

    def send(self, chunk: GenerationChunk) -> None:
        chunk.stats = self.stats.snapshot()
        self.sink(chunk)

    def fail(self, exc: Exception) -> None:
        self.done = True
        self.sink(exc)


def _ignore_eos(sampling) -> bool:
    return bool(getattr(sampling, "ignore_eos", False))
