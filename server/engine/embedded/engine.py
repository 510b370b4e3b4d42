"""The embedded engine: a draft + target pair in this process behind `server.engine.protocol.Engine`.

    engine = EmbeddedEngine(EmbeddedEngineConfig(target_path, draft_path, num_draft=5))
    await engine.start()
    async for chunk in engine.generate(request): ...

Terms
    pair        two HF-format checkpoints (Llama/Qwen2 family) that share one tokenizer; the
                tokenizer and chat template are read from the target directory.
    max_context prompt + completion tokens a request may use; requests that cannot fit are
                rejected before the first chunk (EngineError 'invalid_request').
    head        optional learned weight head, `head(h_draft [R,N,Hd], h_target [R,N,Ht], dial [R])
                -> w [R,N]` in [0,1]; used by requests with a `Verification.dial`.
The model math runs on a scheduler thread (see `scheduler.py`); chunks cross to the caller's event
loop through an `asyncio.Queue`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from server.engine.embedded.cpu_threads import intra_op_threads, scheduler_threads
from server.engine.embedded.dtype_choice import DTYPES, choose_dtype
from server.engine.embedded.grammar import EngineGrammars, GrammarCache, GrammarError, xgrammar_installed
from server.engine.embedded.models import Models, WeightHead
from server.engine.embedded.request_checks import checked_sampling
from server.engine.embedded.row import Row, RowMode
from server.engine.embedded.scheduler import Scheduler
from server.engine.embedded.tokenization import encode_chat, max_token_bytes, stop_ids
from server.engine.protocol import (
    EngineError,
    EngineInfo,
    GenerationChunk,
    GenerationRequest,
    SamplingOptions,
)
from server.engine.token_bytes import TokenBytes
from verifier.dial import DEFAULT_AUTO_DIAL


def default_cache_dir() -> Path:
    """Where measured cost models and dtype choices are kept (`DIALSPEC_CACHE_DIR`, else
    `$XDG_CACHE_HOME/dialspec`, else `~/.cache/dialspec`)."""
    import os

    if os.environ.get("DIALSPEC_CACHE_DIR"):
        return Path(os.environ["DIALSPEC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dialspec"


def default_pair_paths() -> tuple[Path, Path, str]:
    """The shipped embedded pair, checksums verified."""
    from server.engine.model_pair import verify_pair

    pair = verify_pair()
    return Path(pair.target), Path(pair.draft), pair.name


@dataclass
class EmbeddedEngineConfig:
    target_path: str | Path | None = None  # None = the shipped embedded pair
    draft_path: str | Path | None = None
    num_draft: int | None = None  # default N; None = goodput-optimal per row and round (0..max_num_draft)
    max_batch: int = 8
    max_context: int = 2048
    device: str = "cpu"
    # None: float32 on CPU, bfloat16 on CUDA; "auto": measured on CPU (dtype_choice.py), bf16 on CUDA
    dtype: str | torch.dtype | None = None
    served_name: str | None = None  # default: the target directory's name
    head: WeightHead | str | Path | None = None  # a callable, or a directory saved by head_store
    max_num_draft: int = 8  # largest N, per request or adaptive (cache slack is sized by it)
    # Adaptive rows with w < 1, at the tokens no draft proposed (an N = 0 round's token, the bonus
    # after N accepted drafts, the first token): True draws them from p (free, and the higher-
    # quality law), False from ν, which costs a draft step each: exactly ν everywhere
    # (`--strict-nu`), but a lower quality can then be slower than a higher one, and a tier
    # slower than plain decoding (row.RowMode.draws_nu; docs/algorithm.md, "Rounds without drafts").
    p_when_undrafted: bool = True
    # Each request's first token from its prompt prefill's last position (an N = 0 round: from p,
    # or from ν for rows that draw from ν there), saving a target forward per request. False: the
    # first round drafts it like any other position, so every generated position is verified by
    # the request's own rule — what `dialspec eval` and training compare methods on (a baseline
    # policy has no rule without a draft and would get p's token at position 1 for free).
    first_token_from_prefill: bool = True
    profile_budget_s: float = 3.0  # the start-up cost profile's time budget (planner/cost_profile.py)
    # Benchmarks only: accept each draft with probability 1 − w·forced_tv instead of the verifier's
    # verdict (every forward, check and bonus step still runs; `forced.force_acceptance`), so random-
    # weight pairs of real shapes run at a real pair's acceptance. Output follows no law. None: off.
    forced_tv: float | None = None
    cache_dir: str | Path | None = None  # cost models and dtype choices; None = not cached
    max_waiting: int = 256  # queue bound; beyond it requests get EngineError 'capacity'
    # Intra-op CPU threads of the scheduler thread. None = auto: 1 for small targets (< 50M
    # parameters) on CPU, torch's default otherwise (cpu_threads.py says why).
    num_threads: int | None = None
    # `response_format`: a schema that has not compiled after this many seconds is refused (its
    # compilation runs off the event loop; xgrammar cannot be interrupted, so it finishes unseen).
    grammar_timeout_s: float = 10.0

    def resolve(self) -> EmbeddedEngineConfig:
        if self.target_path is None or self.draft_path is None:
            target, draft, name = default_pair_paths()
            self.target_path, self.draft_path = target, draft
            self.served_name = self.served_name or name
        self.target_path, self.draft_path = Path(self.target_path), Path(self.draft_path)
        self.served_name = self.served_name or self.target_path.name
        self.max_num_draft = max(self.max_num_draft, self.num_draft or 0)
        if isinstance(self.dtype, str) and self.dtype != "auto":
            self.dtype = DTYPES[self.dtype]
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        if self.forced_tv is not None and not 0.0 <= self.forced_tv <= 1.0:
            raise ValueError(f"forced_tv must lie in [0, 1], got {self.forced_tv}")
        return self


class EmbeddedEngine:
    def __init__(self, config: EmbeddedEngineConfig):
        from transformers import AutoTokenizer

        self.config = config.resolve()
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.target_path))
        cfg = json.loads((config.target_path / "config.json").read_text())
        self.eos_ids = stop_ids(self.tokenizer, cfg)
        self.vocab_size = cfg["vocab_size"]
        # A head directory is loaded and checked against the pair here, so a mismatch fails when
        # the engine is built (before any server listens); load_models only moves it to the device.
        self.head = self._resolve_head()
        head_config = getattr(self.head, "config", None)
        self.info = EngineInfo(
            model=config.served_name,
            max_context=config.max_context,
            max_batch=config.max_batch,
            num_draft=config.num_draft or config.max_num_draft,
            has_head=config.head is not None,
            backend="embedded",
            auto_dial=getattr(head_config, "default_dial", DEFAULT_AUTO_DIAL),
            adaptive_draft=config.num_draft is None,
            max_num_draft=config.max_num_draft,
            vocab_size=self.vocab_size,
            max_token_bytes=max_token_bytes(self.tokenizer),
            token_provenance=True,  # rows report each token's source and w (row.py, `_provenance`)
            token_logprobs=True,  # rows report the log-probs of each token's law (logprobs.py)
            structured_output=xgrammar_installed(),  # response_format (grammar.py), with the extra installed
        )
        self._grammars = EngineGrammars(
            self.tokenizer, self.vocab_size, self.eos_ids, config.grammar_timeout_s
        )
        self.token_bytes = TokenBytes(self.tokenizer)  # shared by the rows that report log-probs
        self.scheduler: Scheduler | None = None
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------
    def load_models(self) -> Models:
        """Load the pair (in the configured or measured dtype), its caches, and the measured cost
        model the draft-length planner works from. Runs with the scheduler thread's CPU threads."""
        c = self.config
        device = torch.device(c.device)
        threads = scheduler_threads(device, c.num_threads, c.target_path)
        with intra_op_threads(threads):
            return self._load_models(device, threads)

    def _load_models(self, device: torch.device, threads: int | None) -> Models:
        from server.engine.embedded.fingerprint import system_fingerprint
        from server.engine.embedded.model.llama import load_model
        from server.engine.embedded.overhead_profile import measure_overheads
        from server.engine.embedded.planner.cost_profile import load_or_profile
        from server.engine.embedded.planner.draft_planner import DraftPlanner

        c = self.config
        cache_dir = Path(c.cache_dir) if c.cache_dir is not None else None
        if c.dtype == "auto":
            c.dtype, why = choose_dtype(c.target_path, c.draft_path, device, c.max_batch, cache_dir)
            self.info.runtime["dtype_choice"] = why
        target = load_model(c.target_path, device, c.dtype)
        draft = load_model(c.draft_path, device, c.dtype)
        if target.args.vocab_size != draft.args.vocab_size:
            raise ValueError(
                f"pair vocabularies differ ({target.args.vocab_size} vs {draft.args.vocab_size})"
            )
        max_seq = c.max_context + c.max_num_draft + 2  # speculative writes run ahead of the text
        models = Models(
            target=target,
            draft=draft,
            target_cache=target.new_cache(c.max_batch, max_seq),
            draft_cache=draft.new_cache(c.max_batch, max_seq),
            device=device,
            head=self.head.to(device).eval() if isinstance(self.head, torch.nn.Module) else self.head,
            num_threads=threads,
            first_token_from_prefill=c.first_token_from_prefill,
            forced_tv=c.forced_tv,
        )

        def overheads(cost) -> None:  # the engine's own time per round and step (overhead_profile.py)
            measure_overheads(models, cost, c.max_batch, self._plain_row)

        cost = load_or_profile(models, c.max_batch, c.max_num_draft, c.profile_budget_s, cache_dir, overheads)
        models.planner = DraftPlanner(cost, c.max_num_draft, alone_batch=c.max_batch)
        self.info.runtime.update(system_fingerprint(models, c, cost))  # the shape seeded rows plan on
        self.info.runtime.update(dtype=str(c.dtype).removeprefix("torch."), device=str(device))
        self.info.runtime["draft_length"] = "adaptive" if c.num_draft is None else c.num_draft
        if c.forced_tv is not None:  # a bench's timing engine: its output follows no law
            self.info.runtime["forced_tv"] = c.forced_tv
        # Where adaptive w < 1 rows draw the tokens no draft proposed: "p" (default) or "nu" (--strict-nu).
        self.info.runtime["undrafted_rounds_draw_from"] = "p" if c.p_when_undrafted else "nu"
        # Static w = 0 (ν = q) on adaptive rows decodes from the draft alone (draft_only.py).
        self.info.runtime["quality_zero"] = "draft only" if c.num_draft is None else "speculative"
        return models

    def cost_model_summary(self) -> dict | None:
        """The live cost model at batch 1 and max_batch (ms per stage), or None before start."""
        if self.scheduler is None or self.scheduler.models.planner is None:
            return None
        sizes = sorted({1, self.config.max_batch})
        return self.scheduler.models.planner.cost.summary(sizes, self.config.max_num_draft)

    def swap_head(self, head: WeightHead | None) -> None:
        """Serve with another weight head from the next round on: evaluation compares several
        heads on one loaded pair. Call between batches (a round reads the head once)."""
        self.config.head = head
        self.head = head
        config = getattr(head, "config", None)
        dial = getattr(config, "default_dial", self.info.auto_dial)
        self.info = dataclasses.replace(self.info, has_head=head is not None, auto_dial=dial)
        if self.scheduler is not None:
            models = self.scheduler.models
            models.head = head.to(models.device).eval() if isinstance(head, torch.nn.Module) else head

    def _resolve_head(self) -> WeightHead | None:
        """The configured head; a directory is loaded with `server.engine.head_store.load_head`, which refuses
        a head trained for a different pair (ValueError naming both)."""
        head, c = self.config.head, self.config
        if isinstance(head, (str, Path)):
            from server.engine.head_store import load_head

            head = load_head(head, target_path=c.target_path, draft_path=c.draft_path)
        return head

    def start_sync(self) -> None:
        if self.scheduler is None:
            self._stopping = False
            self.scheduler = Scheduler(self.load_models(), self.config.max_batch, probe=self._probe_row)
            self.info.runtime["cost_model"] = self.cost_model_summary()
            self.scheduler.start()

    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    async def stop(self) -> None:
        if self.scheduler is not None:
            self._stopping = True
            sched, self.scheduler = self.scheduler, None
            await asyncio.to_thread(sched.stop, EngineError("engine stopped", "unavailable"))

    @property
    def fault(self) -> BaseException | None:
        """The unrecoverable fault that stopped the scheduler, if any (protocol.engine_fault)."""
        sched = self.scheduler
        return sched.fault if sched is not None else None

    async def readiness(self) -> str | None:
        sched = self.scheduler
        if self._stopping:
            return "the engine is stopping"
        if sched is None:
            return "the engine is not started (models not loaded)"
        if sched.fault is not None:
            return f"the engine failed ({type(sched.fault).__name__}) and cannot generate; restart the server"
        if not sched.alive:
            return "the engine's scheduler thread is not running"
        return None

    def _internal_row(self, request: GenerationRequest, num_draft: int) -> Row:
        """A request of the engine's own (probe, overhead profile): a fixed N, its output dropped."""
        return Row(request, lambda _item: None, num_draft, self.tokenizer, self.eos_ids)

    def _probe_row(self) -> Row:
        """A tiny greedy request with the engine's default (or largest) N, fixed: if this fails, the
        engine is broken."""
        token = min(self.eos_ids, default=0)
        request = GenerationRequest(
            "engine-probe",
            (token, token),
            # one token from the prefill, then one full round of N drafts
            SamplingOptions(temperature=0, max_tokens=self.info.num_draft + 2, ignore_eos=True),
        )
        return self._internal_row(request, self.info.num_draft)

    def _plain_row(self, i: int) -> Row:
        """A dummy plain request (N = 0) of `overhead_profile.TOKENS` tokens after a short prompt."""
        from server.engine.embedded.overhead_profile import TOKENS

        prompt = tuple((i + j) % self.vocab_size for j in range(min(32, self.config.max_context // 2)))
        options = SamplingOptions(max_tokens=TOKENS, ignore_eos=True, seed=i)
        return self._internal_row(GenerationRequest(f"engine-overheads-{i}", prompt, options), 0)

    def load(self) -> dict[str, int]:
        return self.scheduler.load() if self.scheduler else {"running": 0, "waiting": 0}

    # -- tokenization ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages, self.info.model)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # -- generation ------------------------------------------------------------------------
    def make_row(self, request: GenerationRequest, sink) -> Row:
        """Validate `request` and build its row; raises EngineError on anything unservable."""
        c, v = self.config, request.verify
        s = checked_sampling(
            request, vocab_size=self.vocab_size, max_context=c.max_context, max_num_draft=c.max_num_draft,
            has_head=c.head is not None, structured_output=self.info.structured_output, forced_tv=c.forced_tv,
        )  # fmt: skip
        fixed = 0 if v.mode == "autoregressive" else (v.num_draft or c.num_draft)
        try:
            request = replace(request, sampling=s)
            # Quality 0 may skip the target unless a benchmark pins every row's N (planner.force).
            planner = self.scheduler.models.planner if self.scheduler is not None else None
            pinned_top = bool(getattr(getattr(self.head, "config", None), "exact_at_full_dial", False))
            mode = RowMode.of(
                v, fixed, strict_nu=not c.p_when_undrafted,
                allow_draft_only=planner is not None and planner.force is None,
                head_exact_at_top=pinned_top, reproducible=s.seed is not None or s.temperature <= 0,
            )  # fmt: skip
            fmt = request.response_format
            row_grammar = None if fmt is None else self.grammars().row(fmt)
            return Row(
                request, sink, fixed or 0, self.tokenizer, self.eos_ids, mode, token_bytes=self.token_bytes,
                grammar=row_grammar,
            )  # fmt: skip
        except GrammarError as exc:
            raise EngineError(str(exc), "invalid_request") from None
        except ValueError as exc:  # e.g. Policy parameter ranges
            raise EngineError(str(exc), "invalid_request") from exc

    def grammars(self) -> GrammarCache:
        """The pair's grammar compiler (built on first use: it reads the whole vocabulary)."""
        return self._grammars.cache(self.scheduler.timers if self.scheduler is not None else None)

    def submit(self, request: GenerationRequest, sink) -> Row:
        """Thread-safe enqueue (used by `generate` and by the synchronous benchmark)."""
        sched = self.scheduler
        if sched is None:
            raise EngineError("engine is not started", "unavailable")
        if sched.fault is not None:
            raise EngineError(f"engine failed: {type(sched.fault).__name__}", "unavailable")
        row = self.make_row(request, sink)
        if sched.load()["waiting"] >= self.config.max_waiting:
            raise EngineError("too many requests waiting; retry later", "capacity")
        sched.submit(row)
        return row

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item) -> None:
            # RuntimeError: the caller's loop is gone; its row is cancelled by `finally` below.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

        if request.response_format is not None and self.info.structured_output:
            timers = self.scheduler.timers if self.scheduler is not None else None
            await self._grammars.compile(request.response_format, timers)
        row = self.submit(request, sink)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished and self.scheduler is not None:
                self.scheduler.cancel(row)
