"""A fake SGLang runtime on loopback that speaks 0.5.23's native `/generate` protocol.

Shapes follow SGLang's `http_server.py` / `tokenizer_manager.py`: non-streaming returns one
JSON `{"text", "output_ids", "meta_info"}`; streaming sends `data: {...}\\n\\n` lines whose `text`
and `output_ids` are cumulative, then `data: [DONE]\\n\\n`; an error inside a stream is a
`data: {"error": {"message", "type", "code", ...}}` line; a rejected request is an HTTP error with
`{"error": {...}}`. `meta_info` carries `prompt_tokens`, `completion_tokens`, `finish_reason`
(`{"type": "length", "length": n}` / `{"type": "stop", "matched": id}` / abort) and the spec
counters computed as SGLang does (proposed = verify rounds × N, accept length = completion /
rounds).

`FakeRuntime.behavior` picks what the next requests get: "ok" (a runtime with dialspec's plugin
live: at w = 0 and temperature > 0 every draft is accepted), "stock" (a runtime whose hooks did
not apply: never every draft accepted), "http500", "http400", "stall" (no bytes for `stall_s`),
"stream_error" (error after two chunks), "abort" (abort finish before output), "cut" (stream
ends without finish or [DONE]), "unhealthy" (/health 503), "plain" (not speculative: no spec
counters). `set_reachable(False)` closes the listening socket (connection refused) and
`set_reachable(True)` reopens it on the same port.
`/server_info` returns `server_info` (SGLang's resolved-arguments dict, trimmed).

Log-probs (`return_logprob`, `top_logprobs_num` k): `meta_info` gets SGLang's cumulative
`output_token_logprobs` (`[logprob, token_id, null]` per output token: `return_text_in_logprobs` is
off) and, for k > 0, `output_top_logprobs` (k entries per token, the emitted one first; with k >= 3
the last is a masked token, whose −inf orjson writes as null). Values: `fake_logprob(i)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

N_DRAFT = 4
# Token texts: one multi-byte character is split across two tokens to exercise U+FFFD holding.
PIECES = ["Hello", " wor", "ld", " \ufffd", "日", "本", "!", " more", " text", " here"]
TEXTS = ["Hello", " wor", "ld", " ", "日", "本", "!", " more", " text", " here"]


def fake_logprob(position: int, rank: int = 0) -> float:
    """The fake's log-prob of the `rank`-th most likely token at output `position` (rank 0: the
    emitted token)."""
    return -0.125 * (position % 4) - 0.5 * rank


def fake_logprob_meta(body: dict, ids: list[int]) -> dict:
    """What SGLang adds to `meta_info` for a `return_logprob` request with output `ids` so far."""
    if not body.get("return_logprob"):
        return {}
    k = int(body.get("top_logprobs_num") or 0)
    meta = {"output_token_logprobs": [[fake_logprob(i), t, None] for i, t in enumerate(ids)]}
    if k:
        tops = []
        for i, t in enumerate(ids):
            top = [[fake_logprob(i), t]] + [[fake_logprob(i, r), 3 + r] for r in range(1, k)]
            if k >= 3:
                top[-1][0] = None  # a masked token: −inf, which orjson writes as null
            tops.append([[lp, tid, None] for lp, tid in top])
        meta["output_top_logprobs"] = tops
    return meta


class FakeRuntime:
    def __init__(self):
        self.behavior = "ok"
        self.stall_s = 5.0
        self.requests: list[dict] = []
        self.server_info: dict = {
            "speculative_algorithm": "STANDALONE",
            "speculative_use_rejection_sampling": True,
            "speculative_num_steps": N_DRAFT,
            "cuda_graph_config": {"decode": {"backend": "full"}, "prefill": {"backend": "breakable"}},
        }
        self.app = self._make_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self.port = 0

    # ------------------------------------------------------------------ protocol

    def _meta(self, body: dict, n_out: int, finish) -> dict:
        sp = body.get("sampling_params") or {}
        w = (sp.get("custom_params") or {}).get("dialspec_w", 1.0)
        if self.behavior == "ok" and w == 0 and sp.get("temperature", 1.0) > 0:
            rounds = max(1, -(-n_out // (N_DRAFT + 1)))  # ν = q: every draft accepted
            correct = rounds * N_DRAFT
        else:
            rounds = max(1, -(-n_out // 3))  # pretend ~3 tokens per verify round
            correct = min(max(0, n_out - rounds), rounds * N_DRAFT - 1)  # never all accepted
        proposed = rounds * N_DRAFT
        meta = {
            "id": body.get("rid", "r"),
            "finish_reason": finish,
            "prompt_tokens": len(body.get("input_ids") or []),
            "completion_tokens": n_out,
            "cached_tokens": 0,
        }
        meta.update(fake_logprob_meta(body, self._ids(n_out)))
        if n_out and self.behavior != "plain":
            meta.update(
                spec_accept_rate=correct / proposed,
                spec_accept_length=n_out / rounds,
                spec_num_correct_drafts=correct,
                spec_num_proposed_drafts=proposed,
                spec_verify_ct=rounds,
            )
        return meta

    def _outputs(self, body: dict):
        """Cumulative (text, ids, finish) per step for this request."""
        sp = body["sampling_params"]
        max_new = int(sp.get("max_new_tokens", 128))
        n = max_new if sp.get("ignore_eos") else min(max_new, len(PIECES))
        texts = [TEXTS[i % len(TEXTS)] for i in range(n)]
        for i in range(1, n + 1):
            # Cumulative text: a split character shows as U+FFFD until its second token arrives.
            text = "".join(texts[: i - 1]) + PIECES[(i - 1) % len(PIECES)]
            finish = None
            if i == n:
                text = "".join(texts[:i])
                finish = {"type": "length", "length": i} if n == max_new else {"type": "stop", "matched": 2}
            yield text, self._ids(i), finish

    @staticmethod
    def _ids(n: int) -> list[int]:
        return [100 + j % len(PIECES) for j in range(n)]

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}) if self.behavior != "unhealthy" else JSONResponse({}, status_code=503)

        @app.get("/server_info")
        async def server_info():
            return JSONResponse(self.server_info)

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.requests.append(body)
            if self.behavior == "http500":
                return JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500)
            if self.behavior == "http400":
                return JSONResponse(
                    {
                        "error": {
                            "message": "bad sampling params",
                            "type": "invalid_request_error",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            if not body.get("stream"):
                text, ids, finish = list(self._outputs(body))[-1]
                return JSONResponse(
                    {"text": text, "output_ids": ids, "meta_info": self._meta(body, len(ids), finish)}
                )
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict):
        def line(obj) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        if self.behavior == "stall":
            await asyncio.sleep(self.stall_s)
        if self.behavior == "abort":
            finish = {"type": "abort", "message": "prompt too long", "status_code": 400, "err_type": None}
            yield line({"text": "", "output_ids": [], "meta_info": self._meta(body, 0, finish)})
            yield b"data: [DONE]\n\n"
            return
        for step, (text, ids, finish) in enumerate(self._outputs(body)):
            if self.behavior == "stream_error" and step == 2:
                err = {"message": "scheduler died", "type": "invalid_request_error", "code": 500}
                yield line({"error": {**err, "retryable": False}})
                break
            if self.behavior == "cut" and step == 2:
                return
            yield line({"text": text, "output_ids": ids, "meta_info": self._meta(body, len(ids), finish)})
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ lifecycle

    def start(self, port: int = 0) -> FakeRuntime:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake SGLang runtime did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)
            self._server = None

    def set_reachable(self, reachable: bool) -> None:
        """Close the listening socket (connection refused), or reopen it on the same port."""
        if reachable and self._server is None:
            self.start(self.port)
        elif not reachable:
            self.stop()


def free_port() -> int:
    """A loopback port with nothing listening (connection refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@contextlib.contextmanager
def sglang_gateway(tokenizer_dir, model: str = "gpu-pair"):
    """A live gateway whose engine is the SGLang client, in front of a `FakeRuntime`:
    `with sglang_gateway(dir) as (engine, server, runtime):` (all stopped on exit)."""
    from server.engine.sglang.client import SGLangEngine
    from server.gateway.app import create_app
    from server.gateway.settings import GatewaySettings
    from tests.scripted_engine import live_server

    runtime = FakeRuntime().start()
    try:
        engine = SGLangEngine(runtime.url, str(tokenizer_dir), model=model)
        with live_server(create_app(engine, GatewaySettings())) as srv:
            yield engine, srv, runtime
    finally:
        runtime.stop()
