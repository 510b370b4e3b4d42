"""The gateway's SGLang engine: `server.engine.protocol.Engine` over HTTP to an SGLang runtime.

Terms
    runtime   an SGLang server (`python -m sglang.launch_server`, see `dialspec runtime`) with the
              dialspec plugin on, or an SGLang router in front of several; both serve the
              native `POST /generate` and `GET /health`, so this client does not care which.
    chunk     one streamed `data: {...}` line of `/generate`: SGLang 0.5.23 sends the cumulative
              `text` and `output_ids` so far plus `meta_info` (`prompt_tokens`,
              `completion_tokens`, `finish_reason` as `{"type": "stop"|"length"|"abort", ...}`
              or null, and on speculative servers `spec_verify_ct`, `spec_num_correct_drafts`,
              `spec_num_proposed_drafts`, `spec_accept_rate`, `spec_accept_length`); the stream
              ends with `data: [DONE]`; errors inside a stream arrive as `{"error": {...}}`.

The dial travels as `sampling_params.custom_params` (`server.sglang_plugin.params`), which the
plugin reads per row inside the verify step. Prompts are tokenized here with the pair's local
tokenizer (the same chat template as the embedded engine) and sent as `input_ids`, so the
runtime and the gateway agree on prompt token counts.

Capabilities (declared in `info`, refused with EngineError('invalid_request') rather than
dropped): the ensemble rule only (the plugin patches SGLang's chain rejection sampler, which has
no lossy/cascade/typical variants); one N per runtime (`--speculative-num-steps`), so a request
may name only that N; the learned head only when the runtime was launched with one (`has_head`,
the operator's statement, checked against the runtime's CUDA-graph settings at start);
log-probs through SGLang's own `return_logprob` / `top_logprobs_num` (output tokens only,
`logprob_start_len` -1), read back from `meta_info` (`stream.logprobs_from_meta`): log ν at the
verified positions and log p at the bonus and the first token, before top-k/top-p, as the plugin
writes them (docs/sglang.md, "Log-probs"; not yet executed against a real runtime). `response_format`
goes to SGLang's own `json_schema` sampling parameter (`{"type": "object"}` for `json_object`, as
SGLang's OpenAI adapter sends it) at every quality: SGLang's grammar masks the target, and the
plugin masks the draft's q with the same vocabulary mask before it forms ν (docs/sglang.md,
"Constraints"), so no w lets a forbidden token through. Not yet executed on a GPU.

Readiness (`readiness()`): `server.engine.sglang.readiness`'s w = 0 probe, run at start and every
`probe.interval` seconds in the background; the gateway's `/ready` reads the cached result.

No torch import: transformers' tokenizer is imported lazily, on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from server.engine.protocol import (
    EngineError,
    EngineInfo,
    GenerationChunk,
    GenerationRequest,
    logprobs_refusal,
)
from server.engine.sglang.readiness import NOT_PROBED, PROBE_PROMPT, ProbeConfig, run_probe
from server.engine.sglang.stream import StreamState, error_message, kind_for_status, stats_from_meta
from server.engine.token_bytes import TokenBytes
from verifier.dial import PolicyKind

__all__ = ["SGLangEngine", "sampling_params_for", "stats_from_meta", "unsupported_reason"]

logger = logging.getLogger(__name__)


JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what SGLang's OpenAI adapter sends for json_object


def sampling_params_for(request: GenerationRequest) -> dict[str, Any]:
    """SGLang `sampling_params` for a dialspec request (SGLang names; -1 top_k = off)."""
    s, v = request.sampling, request.verify
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "max_new_tokens": s.max_tokens,
        "custom_params": v.validate().to_custom_params(),  # the plugin reads these keys
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    if s.ignore_eos:
        out["ignore_eos"] = True
    if (fmt := request.response_format) is not None:
        out["json_schema"] = fmt.schema if fmt.kind == "json_schema" else JSON_OBJECT_SCHEMA
    return out


def unsupported_reason(info: EngineInfo, request: GenerationRequest) -> str | None:
    """Why `request` asks for something the runtime described by `info` cannot do, or None
    (autoregressive requests are served as w = 1: exactly the target)."""
    if request.logprobs is not None:
        if not info.token_logprobs:
            return "logprobs are not supported by this SGLang backend; remove logprobs from the request"
        if (why := logprobs_refusal(request.logprobs, request.verify)) is not None:
            return why
    if request.response_format is not None and not info.structured_output:
        return "response_format is not supported by the SGLang backend yet; remove it from the request"
    return info.unsupported(request.verify)


class SGLangEngine:
    """`Engine` backed by an SGLang runtime or router at `base_url` (e.g. http://gpu-0:30000)."""

    def __init__(
        self,
        base_url: str,
        tokenizer_dir: str,
        *,
        model: str = "dialspec-pair",
        num_draft: int = 5,
        max_context: int = 4096,
        max_batch: int = 48,
        has_head: bool = False,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        probe: ProbeConfig | None = None,
    ):
        """`has_head`: the runtime was launched with a learned head (`dialspec runtime launch
        --head`); the runtime does not report it, so the operator states it. `probe`: the
        readiness probe's schedule and size (default `ProbeConfig()`)."""
        self.base_url = base_url.rstrip("/")
        self.tokenizer_dir = tokenizer_dir
        self.info = EngineInfo(
            model=model,
            max_context=max_context,
            max_batch=max_batch,
            num_draft=num_draft,
            has_head=has_head,
            backend="sglang",
            policies=(PolicyKind.ENSEMBLE,),
            max_num_draft=None,  # one N per runtime (--speculative-num-steps)
            structured_output=True,  # SGLang's grammar on p, the plugin's mask on q
            token_logprobs=True,  # SGLang's return_logprob: log ν as the plugin writes it (docs/sglang.md)
        )
        # read_timeout bounds the gap between two chunks (and the wait for the first one).
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tokenizer = None
        self._token_bytes: TokenBytes | None = None  # renders log-prob tokens (built on first use)
        self._running = 0
        self.probe = probe or ProbeConfig()
        self._not_ready: str | None = NOT_PROBED
        self._probe_task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the pool, check `/health` (EngineError('unavailable') if down), check the head
        setting against the runtime, run the first plugin probe and schedule the next ones.
        A failed probe does not fail start: it makes `readiness()` report the reason."""
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=self._timeout, headers=self._headers, transport=self._transport
        )
        try:
            resp = await self._client.get("/health")
        except httpx.HTTPError as exc:
            await self.stop()
            raise EngineError(
                f"SGLang runtime at {self.base_url} unreachable: {exc!r}", "unavailable"
            ) from exc
        if resp.status_code != 200:
            await self.stop()
            raise EngineError(
                f"SGLang runtime at {self.base_url} unhealthy: HTTP {resp.status_code}", "unavailable"
            )
        if self.info.has_head:
            await self._check_head_setting()
        await self.probe_now()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="dialspec-sglang-probe")

    async def _check_head_setting(self) -> None:
        """A head needs every CUDA graph off (the plugin refuses to start otherwise), so a runtime
        whose `/server_info` shows a graph backend on was not launched with one."""
        try:
            resp = await self._client.get("/server_info")
            config = resp.json().get("cuda_graph_config") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            config = None
        if not isinstance(config, dict):
            return  # older or proxied runtime (a router): nothing to check against
        on = [phase for phase, c in config.items() if isinstance(c, dict) and c.get("backend") != "disabled"]
        if on:
            await self.stop()
            raise EngineError(
                f"has_head is set but the SGLang runtime at {self.base_url} runs CUDA graphs "
                f"({', '.join(on)}), which a learned head forbids: it was not launched with --head",
                "unavailable",
            )

    async def stop(self) -> None:
        """Close the pool; open streams are cut, which makes SGLang abort those requests."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe_task
            self._probe_task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- readiness ---------------------------------------------------------------------------

    async def readiness(self) -> str | None:
        """None when the last probe proved the plugin live, else the reason (see
        server.engine.sglang.readiness). Answers from the cached result; never blocks on HTTP."""
        if self._client is None:
            return "the SGLang engine is not started"
        return self._not_ready

    async def probe_now(self) -> str | None:
        """Run one probe now, store and return its result."""
        if self._client is None:
            self._not_ready = "the SGLang engine is not started"
            return self._not_ready
        try:
            prompt = await asyncio.to_thread(self.encode_prompt, PROBE_PROMPT)
        except Exception as exc:  # a broken tokenizer must not kill the probe loop
            result = f"the plugin probe could not tokenize its prompt: {exc!r}"
        else:
            result = await run_probe(self._client, prompt, self.probe)
        if result != self._not_ready:
            log = logger.info if result is None else logger.warning
            log("SGLang runtime %s: %s", self.base_url, result or "dialspec plugin live (probe passed)")
        self._not_ready = result
        return result

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe.interval)
            await self.probe_now()

    def load(self) -> dict[str, int]:
        """Requests this gateway has in flight; the runtime's own queue is not visible here."""
        return {"running": self._running, "waiting": 0}

    # -- tokenization ------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # lazy: keeps the gateway import light

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return self._tokenizer

    @property
    def token_bytes(self) -> TokenBytes:
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    # -- generation --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._client is None:
            raise EngineError("SGLang engine not started", "unavailable")
        reason = unsupported_reason(self.info, request)
        if reason is not None:
            raise EngineError(reason, "invalid_request")
        body = {
            "input_ids": list(request.prompt_token_ids),
            "sampling_params": sampling_params_for(request),
            "stream": True,
            "rid": request.request_id,
        }
        if request.logprobs is not None:
            # SGLang's native names: output tokens only (-1: no prompt positions), their k most likely
            # alternatives; the texts are rendered here from the token ids (`TokenBytes`).
            body.update(return_logprob=True, top_logprobs_num=request.logprobs, logprob_start_len=-1)
        weight = 1.0 if request.verify.mode == "autoregressive" else request.verify.weight
        state = StreamState(
            prompt_tokens=len(request.prompt_token_ids),
            weight=weight,
            logprobs=request.logprobs,
            token_bytes=self.token_bytes if request.logprobs is not None else None,
        )
        self._running += 1
        try:
            async with self._client.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    detail = error_message(await resp.aread())
                    raise EngineError(
                        f"SGLang /generate HTTP {resp.status_code}: {detail}",
                        kind_for_status(resp.status_code),
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = state.feed(json.loads(payload))
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
            # Stream ended without a finish_reason: the runtime dropped the request.
            if state.emitted_any:
                yield state.abort_chunk()
            else:
                raise EngineError("SGLang stream ended before any output", "unavailable")
        except httpx.TimeoutException as exc:
            raise EngineError(f"SGLang runtime timed out ({type(exc).__name__})", "unavailable") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang runtime request failed: {exc!r}", "unavailable") from exc
        finally:
            self._running -= 1
