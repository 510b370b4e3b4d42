"""The acceptance suite's run: which servers start in which order, what is asked of each.

Servers run one at a time (a GPU rarely holds three pairs): first the plugin runtime once per
draft-path configuration (collecting samples), then a plain target server and a plain draft
server (the reference laws). Verdicts come from sglang_acceptance_checks.

    plugin, every config   server_info; hooks-live log and w = 0 probe; meta_info counters;
                           metrics; greedy w = 1 outputs; w = 1 law samples; acceptance at
                           w = 1 < w = 0
    plugin, full config    + the acceptance sweep w ∈ {1, .75, .5, .25, 0}; greedy w = 0;
                           w < 1 law samples (power and ν); the mixed-w batch; a log-prob request
    plain target           reference samples; greedy outputs; top-K next-token log-probs p at
                           each tested context
    plain draft            q at the same tokens (`token_ids_logprob`)
`Servers` starts a server and returns its URL and log; tests pass fake servers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import sglang_acceptance_checks as checks
from sglang_acceptance_client import Client, GaugePoller, Generation

from server.sglang_plugin.params import custom_params_for
from verifier.dial import Verification

RUNNING = "sglang:num_running_reqs"
# SGLang refreshes its running-requests gauge every `--decode-log-interval` decode steps (default
# 40, longer than a short batch lives); the batching check needs it refreshed every step.
PLUGIN_FLAGS = ("--decode-log-interval", "1")


@dataclass(frozen=True)
class RunConfig:
    """A plugin-server configuration: extra SGLang flags; `full` runs every check on it; `batch`
    caps the requests per call (small batches exercise the CUDA-graph path)."""

    name: str
    flags: tuple[str, ...] = ()
    full: bool = False
    batch: int | None = None


DRAFT_PATHS = (
    RunConfig("default: CUDA graphs, overlap", (), full=True),
    RunConfig("eager: --disable-cuda-graph", ("--disable-cuda-graph",)),
    RunConfig("graph/eager mix: --cuda-graph-max-bs-decode 4", ("--cuda-graph-max-bs-decode", "4"), batch=3),
    RunConfig("no overlap: --disable-overlap-schedule", ("--disable-overlap-schedule",)),
)


@dataclass
class SuiteOptions:
    num_draft: int
    law_prompts: list[list[int]]
    greedy_prompts: list[list[int]]
    law_samples: int = 2000  # per prompt and arm
    law_tokens: int = 4  # L: positions 2..L are tested
    sweep_weights: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25, 0.0)
    sweep_requests: int = 64
    sweep_tokens: int = 96
    probe_requests: int = 16
    probe_tokens: int = 64
    greedy_tokens: int = 64
    nu_weight: float = 0.5
    mixed_concurrency: int = 48  # requests per batched call, alternating w = 0 / w = 1
    mixed_samples: int = 1200  # per group
    mixed_tokens: int = 32  # long enough for the batch to be seen running; y1, y2 are tested
    min_context: int = 200  # y2 samples needed to test a context
    top_k: int = 20
    alpha: float = 1e-3  # false-alarm level of each check (Bonferroni inside)
    greedy_tolerance: float = 0.1
    bootstrap_draws: int = 10000
    seed: int = 0
    batch: int = 256


@dataclass
class Handle:
    url: str
    command: str
    log: Callable[[], str]


class Servers(Protocol):
    def start(self, role: str, flags: tuple[str, ...]) -> Handle:
        """role: "plugin" (dialspec runtime), "target" or "draft" (plain SGLang)."""
        ...

    def stop(self, handle: Handle) -> None: ...


@dataclass
class Collected:
    """What one plugin configuration produced for the deferred (reference-needing) checks."""

    config: RunConfig
    greedy: list[list[int]] = field(default_factory=list)
    law: dict[float, list[list[tuple[int, ...]]]] = field(default_factory=dict)  # w -> per prompt
    mixed: dict[float, list[tuple[int, ...]]] = field(default_factory=dict)  # w -> samples


class Suite:
    def __init__(self, opts: SuiteOptions, servers: Servers, configs=DRAFT_PATHS):
        self.opts, self.servers, self.configs = opts, servers, tuple(configs)
        self.results: list[checks.CheckResult] = []
        self.commands: dict[str, str] = {}
        self._servers_started = 0  # seeds differ per server: samples of two servers are independent

    def run(self) -> list[checks.CheckResult]:
        collected = [c for c in (self._plugin(cfg) for cfg in self.configs) if c is not None]
        contexts = self._contexts(collected)
        target = self._reference("target", contexts)
        draft = self._reference("draft", contexts) if target is not None else None
        if target is not None and draft is not None:
            self._evaluate(collected, target, draft, contexts)
        return self.results

    # -- helpers ------------------------------------------------------------------------------
    def _add(self, result: checks.CheckResult) -> None:
        self.results.append(result)

    def _start(self, role: str, flags: tuple[str, ...], label: str) -> Handle | None:
        try:
            handle = self.servers.start(role, flags)
        except Exception as exc:
            self._add(
                checks.CheckResult(
                    f"{role} server starts", label, checks.FAIL, f"{type(exc).__name__}: {exc}"
                )
            )
            return None
        self.commands[label] = handle.command
        self._servers_started += 1
        return handle

    def _client(self, handle: Handle) -> Client:
        return Client(handle.url, seed=self.opts.seed * 1000 + self._servers_started)

    def _sample(
        self, client: Client, prompt, n, tokens, temperature, w=None, batch=None, ws=None
    ) -> list[Generation]:
        return client.sample(prompt, n, tokens, temperature, w, batch or self.opts.batch, ws)

    # -- plugin runtime -----------------------------------------------------------------------
    def _plugin(self, cfg: RunConfig) -> Collected | None:
        o, name = self.opts, cfg.name
        handle = self._start("plugin", (*cfg.flags, *PLUGIN_FLAGS), name)
        if handle is None:
            return None
        client, out = self._client(handle), Collected(cfg)
        try:
            self._add(checks.check_server_info(client.server_info(), o.num_draft, name))
            probe = self._sample(
                client, o.law_prompts[0], o.probe_requests, o.probe_tokens, 1.0, 0.0, cfg.batch
            )
            self._add(checks.check_all_accepted(probe, name))
            seen = list(probe)
            sweep_ws = o.sweep_weights if cfg.full else (1.0, 0.0)
            by_w = {}
            for w in sweep_ws:
                gens = self._sample(
                    client, o.law_prompts[0], o.sweep_requests, o.sweep_tokens, 1.0, w, cfg.batch
                )
                by_w[w], seen = [(g.accepted, g.proposed) for g in gens], seen + gens
            self._add(checks.check_sweep(by_w, o.alpha, o.bootstrap_draws, o.seed, name))
            greedy = [self._sample(client, p, 1, o.greedy_tokens, 0.0, 1.0)[0] for p in o.greedy_prompts]
            out.greedy, seen = [g.tokens for g in greedy], seen + greedy
            law_prompts = o.law_prompts if cfg.full else o.law_prompts[:1]
            law_ws = (1.0, o.nu_weight) if cfg.full else (1.0,)
            for w in law_ws:
                n = o.law_samples if cfg.full else max(1, o.law_samples // 2)
                out.law[w] = [
                    [tuple(g.tokens) for g in self._sample(client, p, n, o.law_tokens, 1.0, w, cfg.batch)]
                    for p in law_prompts
                ]
            if cfg.full:
                g0 = [self._sample(client, p, 1, o.greedy_tokens, 0.0, 0.0)[0] for p in o.greedy_prompts]
                self._add(checks.check_greedy_w0(g0, o.num_draft, name))
                seen += g0 + self._mixed(client, out)
                lp = client.generate(
                    [o.law_prompts[0]] * 2,
                    [
                        dict(s, custom_params=custom_params_for(Verification(weight=0.5)))
                        for s in (_plain(1.0, 16), _plain(0.0, 16))
                    ],
                    return_logprob=True,
                    top_logprobs_num=5,
                )
                self._add(checks.check_logprobs(lp, name))
            self._add(checks.check_counters(seen, o.num_draft, name))
            self._add(checks.check_metrics(client.metrics(), name))
        except Exception as exc:  # a crashed runtime is a failed check, not a crashed suite
            self._add(
                checks.CheckResult(
                    "plugin runtime answers", name, checks.FAIL, f"{type(exc).__name__}: {exc}"
                )
            )
        finally:
            client.close()
            self._add(checks.check_log(handle.log(), name))
            self.servers.stop(handle)
        return out

    def _mixed(self, client: Client, out: Collected) -> list[Generation]:
        o = self.opts
        k = o.mixed_concurrency
        ws = [0.0 if i % 2 == 0 else 1.0 for i in range(2 * o.mixed_samples)]
        with GaugePoller(client, RUNNING) as poller:
            gens = self._sample(client, o.law_prompts[0], len(ws), o.mixed_tokens, 1.0, batch=k, ws=ws)
        self._add(checks.check_batched(poller.peak, min(40, k), out.config.name))
        out.mixed = {
            w: [tuple(g.tokens) for g, wi in zip(gens, ws, strict=True) if wi == w] for w in (0.0, 1.0)
        }
        self._add(
            checks.check_all_accepted(
                [g for g, wi in zip(gens, ws, strict=True) if wi == 0.0],
                out.config.name,
                "mixed batch: w = 0 rows accept every draft",
            )
        )
        return gens

    # -- references -----------------------------------------------------------------------------
    def _contexts(self, collected: list[Collected]) -> dict[tuple[int, int], list[int]]:
        """(prompt index, y1) -> context token ids, for every context a ν test will use."""
        o, ctx = self.opts, {}
        for c in collected:
            if not c.config.full:
                continue
            sources = [(i, s) for i, s in enumerate(c.law.get(o.nu_weight, []))]
            sources += [(0, c.mixed.get(w, [])) for w in (0.0, 1.0)]
            for i, samples in sources:
                for y1 in checks.contexts(samples, o.min_context):
                    ctx[(i, y1)] = [*o.law_prompts[i], y1]
        return ctx

    def _reference(self, role: str, contexts) -> dict | None:
        o = self.opts
        handle = self._start(role, (), f"plain {role}")
        if handle is None:
            return None
        client, ref = self._client(handle), {"probs": {}}
        try:
            if role == "target":
                ref["law"] = [
                    [tuple(g.tokens) for g in self._sample(client, p, o.law_samples, o.law_tokens, 1.0)]
                    for p in o.law_prompts
                ]
                ref["greedy"] = [
                    self._sample(client, p, 1, o.greedy_tokens, 0.0)[0].tokens for p in o.greedy_prompts
                ]
                ref["probs"] = {
                    key: client.next_token_probs(ids, top_k=o.top_k) for key, ids in contexts.items()
                }
            else:
                ref["probs"] = {
                    key: client.next_token_probs(ids, token_ids=sorted(self._cells[key]))
                    for key, ids in contexts.items()
                }
        except Exception as exc:
            self._add(
                checks.CheckResult(
                    f"plain {role} answers", f"plain {role}", checks.FAIL, f"{type(exc).__name__}: {exc}"
                )
            )
            ref = None
        finally:
            client.close()
            self.servers.stop(handle)
        if role == "target" and ref is not None:
            self._cells = {key: set(p) for key, p in ref["probs"].items()}
        return ref

    # -- verdicts needing references ------------------------------------------------------------
    def _evaluate(self, collected: list[Collected], target: dict, draft: dict, contexts) -> None:
        o = self.opts
        positions = range(2, o.law_tokens + 1)
        for c in collected:
            name = c.config.name
            self._add(checks.check_greedy_match(c.greedy, target["greedy"], o.greedy_tolerance, name))
            if 1.0 in c.law:
                self._add(
                    checks.check_law_equal(
                        c.law[1.0], target["law"][: len(c.law[1.0])], positions, o.alpha, name
                    )
                )
            if not c.config.full:
                continue
            self._add(
                checks.check_power(c.law[o.nu_weight], target["law"], positions, o.alpha, o.nu_weight, name)
            )
            self._add(
                self._nu_check(
                    f"w = {o.nu_weight:g}: y2 | context follows ν",
                    c.law[o.nu_weight],
                    o.nu_weight,
                    target,
                    draft,
                    name,
                )
            )
            for w in (0.0, 1.0):
                self._add(
                    self._nu_check(
                        f"mixed batch: w = {w:g} rows follow their own ν",
                        [c.mixed[w]],
                        w,
                        target,
                        draft,
                        name,
                    )
                )

    def _nu_check(
        self, label: str, per_prompt, w: float, target: dict, draft: dict, config: str
    ) -> checks.CheckResult:
        tests = []
        for i, samples in enumerate(per_prompt):
            for y1, y2s in checks.contexts(samples, self.opts.min_context).items():
                p, q = target["probs"].get((i, y1)), draft["probs"].get((i, y1))
                if p and q:
                    tests.append((f"prompt {i}, y1 = {y1}", y2s, checks.mix(p, q, w)))
        return checks.check_nu(tests, self.opts.alpha, label, config)


def _plain(temperature: float, tokens: int) -> dict:
    return {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": tokens,
        "ignore_eos": True,
    }
