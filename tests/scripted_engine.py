"""A small scripted engine implementing `server.engine.protocol.Engine`, for fast gateway tests.

Deterministic, torch-free. Tokens are UTF-8 bytes of the text (so ids < 256). The output is a
script of words chosen by a `random.Random` seeded from the request's seed (or the prompt when no
seed, or always the prompt at temperature 0), so equal requests give equal outputs.

Speculation is simulated with the ensemble law: each draft position is accepted with probability
`beta = 1 - w * TV` (TV = `self.tv`), a round emits the accepted prefix plus one token, and
`SpecStats` are filled exactly as a real engine would. Knobs for tests:
    step_delay     seconds slept per round (make requests slow for disconnect/overload tests)
    fail_next      an EngineError raised before the first chunk of the next request
    not_ready      a reason `readiness()` reports (None = ready once started)
    fault          an unrecoverable fault (protocol.engine_fault): the gateway shuts down
    active         request ids generating now;  cancelled  ids closed before finishing
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence

from server.engine.protocol import EngineError, EngineInfo, GenerationChunk, GenerationRequest, SpecStats
from verifier.dial import PolicyKind

WORDS = ["alpha", "beta", "gamma", "delta", "dial", "draft", "target", "token", "verify", "ensemble"]


class ScriptedEngine:
    def __init__(
        self,
        *,
        model: str = "scripted-pair",
        max_context: int = 512,
        max_batch: int = 4,
        num_draft: int = 4,
        has_head: bool = False,
        step_delay: float = 0.0,
        tv: float = 0.6,
        script_words: int = 60,
    ):
        self.info = EngineInfo(
            model=model,
            max_context=max_context,
            max_batch=max_batch,
            num_draft=num_draft,
            has_head=has_head,
            backend="scripted",
            max_num_draft=2 * num_draft,
            vocab_size=256,
            max_token_bytes=1,  # a token is one byte: exactly bytes tokens
        )
        self.step_delay = step_delay
        self.tv = tv
        self.script_words = script_words
        self.fail_next: EngineError | None = None
        self.not_ready: str | None = None
        self.fault: BaseException | None = None
        self.active: set[str] = set()
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.started = False
        self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def readiness(self) -> str | None:
        if not self.started or self.stopped:
            return "the scripted engine is not running"
        return self.not_ready

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(prompt.encode("utf-8"))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode_prompt(text)

    def load(self) -> dict[str, int]:
        return {"running": len(self.active), "waiting": 0}

    def script(self, request: GenerationRequest) -> bytes:
        s = request.sampling
        if s.temperature == 0 or s.seed is None:
            rng = random.Random(bytes(request.prompt_token_ids))
        else:
            rng = random.Random(s.seed)
        return " ".join(rng.choice(WORDS) for _ in range(self.script_words)).encode() + b"."

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        s, v = request.sampling, request.verify
        prompt_len = len(request.prompt_token_ids)
        if prompt_len + s.max_tokens > self.info.max_context:
            raise EngineError("prompt + max_tokens exceeds max_context", "invalid_request")
        script = self.script(request)
        rng = random.Random(hash((request.request_id, s.seed)) if s.seed is None else s.seed + 1)
        n = 0 if v.mode == "autoregressive" else (v.num_draft or self.info.num_draft)
        w = v.weight if v.policy == PolicyKind.ENSEMBLE else 1.0
        beta = 1.0 - w * self.tv
        stats = SpecStats(accepted_per_position=[0] * n)
        out = b""
        finished = False
        self.active.add(request.request_id)
        try:
            while True:
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                stats.verify_steps += 1
                if n:
                    accepted = 0
                    while accepted < n and rng.random() < beta:
                        stats.accepted_per_position[accepted] += 1
                        accepted += 1
                    stats.drafts += 1
                    stats.draft_tokens += n
                    stats.accepted_tokens += accepted
                    # Like the embedded engine: every proposed position counts its w, whether or not
                    # the chain got that far (row.py, record_round).
                    stats.weight_sum += w * n
                    stats.weight_count += n
                    take = accepted + 1
                else:
                    take = 1
                take = min(take, s.max_tokens - len(out), len(script) - len(out))
                new = script[len(out) : len(out) + take]
                out += new
                text, finish = new.decode(), None
                for stop in s.stop:
                    cut = out.decode().find(stop)
                    if cut >= 0:
                        out = out[:cut]
                        text, finish = "", "stop"  # simplification: the stop text is dropped
                        break
                if finish is None and len(out) >= len(script):
                    finish = "stop"
                elif finish is None and len(out) >= s.max_tokens:
                    finish = "length"
                yield GenerationChunk(
                    text=text,
                    token_ids=list(new),
                    prompt_tokens=prompt_len,
                    completion_tokens=len(out),
                    finish_reason=finish,
                    stats=stats if finish else None,
                )
                if finish:
                    finished = True
                    self.finished.append(request.request_id)
                    return
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.cancelled.append(request.request_id)


class LiveServer:
    """The gateway's server (listen.make_server) on a random free loopback port, in a thread.
    `url` is the base URL; `stop()` shuts down as SIGTERM does (drain, then exit)."""

    def __init__(self, app, startup_timeout: float = 120.0):
        from server.gateway.listen import make_server, tcp_socket

        self.sock = tcp_socket("127.0.0.1")
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, {"log_level": "warning", "timeout_graceful_shutdown": 10})
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("live server failed to start")
            time.sleep(0.02)

    def begin_stop(self) -> None:
        """Start the shutdown (as SIGTERM does) without waiting for it."""
        self.server.begin_shutdown()

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down as SIGTERM does: drain, then uvicorn exits and the lifespan stops the engine."""
        self.begin_stop()
        self.thread.join(timeout)
        self.sock.close()


@contextlib.contextmanager
def live_server(app, startup_timeout: float = 120.0):
    """`with live_server(app) as srv:` -> LiveServer, stopped on exit."""
    srv = LiveServer(app, startup_timeout)
    try:
        yield srv
    finally:
        srv.stop()
