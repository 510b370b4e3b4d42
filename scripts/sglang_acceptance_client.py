"""HTTP client of the SGLang acceptance suite: SGLang 0.5.23's native API, batched.

`/generate` takes a batch as lists (`input_ids: [[...], ...]`, `sampling_params: [{...}, ...]`)
and answers a list of `{"text", "output_ids", "meta_info"}`; with `return_logprob`, `meta_info`
carries `output_token_logprobs` (per position `[logprob, token_id, text]`), `output_top_logprobs`
(per position a list of those) and `output_token_ids_logprobs` (for `token_ids_logprob`).
Other endpoints: `/health`, `/server_info` (`/get_server_info` before it), `/metrics`.

Sampling is always untruncated (top_p = 1, top_k = −1), `ignore_eos`, and every request has its
own `sampling_seed`: under `--enable-deterministic-inference` SGLang seeds unseeded requests with
42, which would make repeated requests identical; without it the seed is ignored and requests
are independent anyway. The suite never relies on seeds for reproducibility.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from server.sglang_plugin.params import custom_params_for
from verifier.dial import Verification


@dataclass
class Generation:
    """One request's answer: generated token ids and SGLang's meta_info."""

    tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return int(self.meta.get("spec_num_correct_drafts") or 0)

    @property
    def proposed(self) -> int:
        return int(self.meta.get("spec_num_proposed_drafts") or 0)

    @property
    def rounds(self) -> int:
        return int(self.meta.get("spec_verify_ct") or 0)

    @property
    def completion(self) -> int:
        return int(self.meta.get("completion_tokens", len(self.tokens)))


def sampling(temperature: float, max_new_tokens: int, seed: int, w: float | None = None) -> dict[str, Any]:
    """SGLang sampling params of one suite request (w None: no dial, e.g. plain servers)."""
    out: dict[str, Any] = {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
        "sampling_seed": seed,
    }
    if w is not None:
        out["custom_params"] = custom_params_for(Verification(weight=w))
    return out


def gauge_max(exposition: str, name: str) -> float | None:
    """Largest value of metric `name` (any labels) in a Prometheus text exposition."""
    values = [
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", exposition, flags=re.M)
        if m.group(1) not in ("NaN", "nan")
    ]
    return max(values) if values else None


class Client:
    """A server (plugin runtime or plain SGLang) at `url`."""

    def __init__(self, url: str, seed: int = 0, timeout: float = 900.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self._base, self._count = seed * 1_000_003, 0

    def close(self) -> None:
        self.http.close()

    def next_seed(self) -> int:
        """A sampling_seed no other request of this suite run uses (for this client's seed)."""
        self._count += 1
        return self._base + self._count

    # -- endpoints --------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            resp = self.http.get(path)
            if resp.status_code == 200:
                return resp.json()
        raise RuntimeError(f"{self.url}: neither /server_info nor /get_server_info answered")

    def metrics(self) -> str:
        resp = self.http.get("/metrics")
        resp.raise_for_status()
        return resp.text

    def healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def generate(
        self, prompts: list[list[int]], params: list[dict[str, Any]], **extra: Any
    ) -> list[Generation]:
        """One batched `/generate` call; one Generation per prompt, in order."""
        body = {"input_ids": prompts, "sampling_params": params, **extra}
        resp = self.http.post("/generate", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url} /generate HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        data = data if isinstance(data, list) else [data]
        return [Generation(list(d.get("output_ids") or []), d.get("meta_info") or {}) for d in data]

    def sample(
        self,
        prompt: list[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        w: float | None = None,
        batch: int = 256,
        ws: list[float] | None = None,
    ) -> list[Generation]:
        """`n` independent generations of `prompt`, `batch` per call (`ws`: one w per request)."""
        out: list[Generation] = []
        while len(out) < n:
            k = min(batch, n - len(out))
            weights = ws[len(out) : len(out) + k] if ws is not None else [w] * k
            params = [sampling(temperature, max_new_tokens, self.next_seed(), wi) for wi in weights]
            out += self.generate([list(prompt)] * k, params)
        return out

    def next_token_probs(
        self, context: list[int], top_k: int = 0, token_ids: list[int] | None = None
    ) -> dict[int, float]:
        """p(token | context) at temperature 1 for the server's `top_k` most likely tokens and/or
        the given `token_ids` (from `output_top_logprobs` / `output_token_ids_logprobs`)."""
        extra: dict[str, Any] = {"return_logprob": True}
        if top_k:
            extra["top_logprobs_num"] = top_k
        if token_ids:
            extra["token_ids_logprob"] = list(token_ids)
        (gen,) = self.generate([list(context)], [sampling(1.0, 1, self.next_seed())], **extra)
        probs: dict[int, float] = {}
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            rows = gen.meta.get(key) or []
            for logprob, token, *_ in (rows[0] or []) if rows else []:
                probs[int(token)] = math.exp(float(logprob))
        return probs


class GaugePoller:
    """Polls a gauge on `/metrics` in a thread while a batch runs; `peak` is the largest value."""

    def __init__(self, client: Client, name: str, period: float = 0.05):
        self.client, self.name, self.period = client, name, period
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        poll = httpx.Client(base_url=self.client.url, timeout=10)
        try:
            while not self._stop.is_set():
                try:
                    value = gauge_max(poll.get("/metrics").text, self.name)
                except httpx.HTTPError:
                    value = None
                if value is not None:
                    self.peak = value if self.peak is None else max(self.peak, value)
                self._stop.wait(self.period)
        finally:
            poll.close()

    def __enter__(self) -> GaugePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
