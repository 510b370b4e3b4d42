"""Fake SGLang servers over a tiny draft/target pair, with the statistics of the real thing.

For the acceptance suite's CPU tests (tests/test_sglang_acceptance.py). A toy pair over V = 6
tokens: the target's next-token law p(· | context) and the draft's q(· | context) are fixed
functions of the last two tokens and the length mod 3 (seeded), with TV(p, q) large enough for
the suite's power checks. Servers speak SGLang 0.5.23's batched `/generate` (see
scripts/sglang_acceptance_client.py), `/health`, `/server_info`, `/metrics`.

    role "plugin"   speculative decoding with N drafts per round exactly as the plugin makes
                    SGLang do it: the first token from p (prefill); drafts from q; accept draft x
                    with probability min(1, ν(x)/q(x)), ν = w·p + (1−w)·q; at a rejection sample
                    norm(max(0, ν − q)); bonus from p. Greedy (temperature 0): drafts argmax q
                    except the first draft after the prefill, which is sampled (as in SGLang);
                    accept while x = argmax ν; emit argmax ν, bonus argmax p.
    role "target" / "draft"   plain sampling from p / q, with top-K and token-id log-probs.

Plugin `mode`: "ok"; "stock" (hooks not live: every request verified at w = 1); "hook_log" (ok,
but the log has SGLang's 'Failed to apply hooks' line); "serial" (ok, but /metrics never shows
more than one running request). Every request's randomness comes from its `sampling_seed`.
"""

from __future__ import annotations

import asyncio
import math
import random

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.fake_sglang import FakeRuntime

V = 6


def _law(context: list[int], salt: str, sharpness: float) -> list[float]:
    rng = random.Random(f"{salt}:{context[-2:]}:{len(context) % 3}")
    logits = [rng.gauss(0.0, sharpness) for _ in range(V)]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def p_law(context: list[int]) -> list[float]:
    return _law(context, "target", 1.6)


def q_law(context: list[int]) -> list[float]:
    """The draft: a blurred target plus its own bias (TV(p, q) ≈ 0.3 on average)."""
    p = p_law(context)
    noise = _law(context, "draft", 1.0)
    mixed = [0.5 * a + 0.5 * b for a, b in zip(p, noise, strict=True)]
    return [x / sum(mixed) for x in mixed]


def _sample(dist: list[float], rng: random.Random) -> int:
    return rng.choices(range(V), weights=dist)[0]


def _argmax(dist: list[float]) -> int:
    return max(range(V), key=dist.__getitem__)


def speculate(prompt: list[int], max_new: int, w: float, greedy: bool, n: int, rng: random.Random):
    """One request through the plugin's rule. Returns (tokens, rounds, accepted drafts)."""
    ctx = list(prompt)
    out = [_argmax(p_law(ctx)) if greedy else _sample(p_law(ctx), rng)]  # prefill token
    rounds = accepted_total = 0
    while len(out) < max_new:
        rounds += 1
        base = ctx + out
        drafts, qs = [], []
        for i in range(n):
            q = q_law(base + drafts)
            sampled_first = greedy and rounds == 1 and i == 0  # SGLang samples this one
            drafts.append(_argmax(q) if greedy and not sampled_first else _sample(q, rng))
            qs.append(q)
        emitted = None
        for i, x in enumerate(drafts):
            p = p_law(base + drafts[:i])
            nu = [w * a + (1 - w) * b for a, b in zip(p, qs[i], strict=True)]
            ok = x == _argmax(nu) if greedy else rng.random() * qs[i][x] < nu[x]
            if not ok:
                if greedy:
                    fix = _argmax(nu)
                else:
                    residual = [max(0.0, a - b) for a, b in zip(nu, qs[i], strict=True)]
                    fix = _sample(residual if sum(residual) > 0 else p, rng)
                emitted = drafts[:i] + [fix]
                break
            accepted_total += 1
        if emitted is None:
            bonus = p_law(base + drafts)
            emitted = drafts + [_argmax(bonus) if greedy else _sample(bonus, rng)]
        out += emitted
    return out[:max_new], rounds, accepted_total


def plain(prompt: list[int], max_new: int, law, greedy: bool, rng: random.Random) -> list[int]:
    out: list[int] = []
    while len(out) < max_new:
        dist = law(list(prompt) + out)
        out.append(_argmax(dist) if greedy else _sample(dist, rng))
    return out


class FakePairServer(FakeRuntime):
    def __init__(self, role: str, mode: str = "ok", num_draft: int = 3):
        self.role, self.mode, self.num_draft = role, mode, num_draft
        self.running = 0
        self.log = "INFO dialspec SGLang plugin (scheduler): all 7 hooks live\n" if role == "plugin" else ""
        if mode == "hook_log":
            self.log += "ERROR Failed to apply hooks to sglang.srt.speculative.eagle_utils.eagle_sample\n"
        super().__init__()

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({})

        @app.get("/server_info")
        async def server_info():
            spec = self.role == "plugin"
            return JSONResponse(
                {
                    "speculative_algorithm": "STANDALONE" if spec else None,
                    "speculative_use_rejection_sampling": spec,
                    "speculative_num_steps": self.num_draft if spec else None,
                    "speculative_eagle_topk": 1 if spec else None,
                }
            )

        @app.get("/metrics")
        async def metrics():
            lines = [f'sglang:num_running_reqs{{model_name="fake"}} {self.running}']
            if self.role == "plugin":
                lines += [
                    'sglang:spec_accept_rate{model_name="fake"} 0.5',
                    'sglang:spec_accept_length{model_name="fake"} 2.0',
                ]
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            prompts, params = body["input_ids"], body["sampling_params"]
            single = bool(prompts) and isinstance(prompts[0], int)
            prompts = [prompts] if single else prompts
            params = params if isinstance(params, list) else [params] * len(prompts)
            self.running = 1 if self.mode == "serial" else len(prompts)
            out = await asyncio.to_thread(
                lambda: [self._one(p, sp, body) for p, sp in zip(prompts, params, strict=True)]
            )
            if len(prompts) >= 8:
                await asyncio.sleep(0.15)  # long enough for the suite's /metrics poller to see it
            self.running = 0
            return JSONResponse(out[0] if single else out)

        return app

    def _one(self, prompt: list[int], sp: dict, body: dict) -> dict:
        rng = random.Random(sp.get("sampling_seed", 0))
        greedy = sp.get("temperature", 1.0) == 0
        max_new = int(sp.get("max_new_tokens", 16))
        meta = {"prompt_tokens": len(prompt)}
        if self.role == "plugin":
            w = float((sp.get("custom_params") or {}).get("dialspec_w", 1.0))
            w = 1.0 if self.mode == "stock" else w
            tokens, rounds, accepted = speculate(prompt, max_new, w, greedy, self.num_draft, rng)
            proposed = rounds * self.num_draft
            meta.update(
                spec_verify_ct=rounds,
                spec_num_proposed_drafts=proposed,
                spec_num_correct_drafts=accepted,
                spec_accept_rate=accepted / proposed if proposed else 0.0,
                spec_accept_length=len(tokens) / rounds if rounds else 0.0,
            )
            law = p_law
        else:
            law = p_law if self.role == "target" else q_law
            tokens = plain(prompt, max_new, law, greedy, rng)
        meta["completion_tokens"] = len(tokens)
        if body.get("return_logprob"):
            dists = [law(list(prompt) + tokens[:i]) for i in range(len(tokens))]
            meta["output_token_logprobs"] = [
                [math.log(d[t]), t, None] for d, t in zip(dists, tokens, strict=True)
            ]
            k = int(body.get("top_logprobs_num") or 0)
            meta["output_top_logprobs"] = [
                [[math.log(d[t]), t, None] for t in sorted(range(V), key=lambda t, d=d: -d[t])[:k]]
                for d in dists
            ]
            ids = body.get("token_ids_logprob") or []
            meta["output_token_ids_logprobs"] = [[[math.log(d[t]), t, None] for t in ids] for d in dists]
        return {"text": "", "output_ids": tokens, "meta_info": meta}
