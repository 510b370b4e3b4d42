"""Log-probs a client sees from an SGLang runtime with the plugin, through SGLang's own code.

Decision (docs/sglang.md, "Log-probs"): at a position decided by the ensemble verifier the
reported log-prob is log ν(token), ν = w·p + (1−w)·q with p SGLang's log-prob distribution
(softmax of the penalised logits over the row's temperature, before top-k/top-p) and q the
draft's proposal distribution; at the bonus slot (all N drafts accepted) it is log p, the law
the bonus is drawn from. The same for greedy and sampled rows; w = 1 rows are stock.

The hook runs around a tensor-level eagle_sample; then SGLang 0.5.23's real
`compute_spec_logprobs` (sglang/srt/layers/logprob_processor.py) turns the logits the hook left
into the log-probs SGLang returns.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from server.sglang_plugin import verify_hooks
from server.sglang_plugin.params import PluginSettings
from tests.sglang_cpu import import_heavy

N, V = 3, 7


@pytest.fixture(scope="module")
def compute_spec_logprobs():
    return import_heavy(["sglang.srt.layers.logprob_processor"])[
        "sglang.srt.layers.logprob_processor"
    ].compute_spec_logprobs


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)


def _req(w, greedy):
    sp = SimpleNamespace(custom_params={"dialspec_w": w}, top_k=1 if greedy else 1 << 30)
    return SimpleNamespace(sampling_params=sp, rid=f"r{w}")


def _case(rows, seed=0):
    """rows: (w, greedy, temperature). SGLang rewrites greedy to temperature 1, top_k 1."""
    g = torch.Generator().manual_seed(seed)
    b = len(rows)
    z = torch.randn(b * (N + 1), V, generator=g) * 2  # [B·(N+1), V] target logits
    q = torch.softmax(torch.randn(b, N, V, generator=g), -1)  # [B, N, V]
    greedy = [gr for _, gr, _ in rows]
    temps = torch.tensor([[1.0 if gr else t] for _, gr, t in rows])  # [B, 1]
    batch = SimpleNamespace(
        reqs=[_req(w, gr) for w, gr, _ in rows],
        forward_mode=SimpleNamespace(is_idle=lambda: False),
        sampling_info=SimpleNamespace(
            top_ks=torch.tensor([1 if gr else 1 << 30 for gr in greedy]),
            temperatures=temps,
            is_all_greedy=all(greedy),
        ),
        return_logprob=True,
        seq_lens=torch.full((b,), 5),
        top_logprobs_nums=[2] * b,
        token_ids_logprobs=None,
    )
    tokens = torch.randint(0, V, (b * (N + 1),), generator=g, dtype=torch.int32)  # emitted per slot
    accept_index = torch.arange(b * (N + 1), dtype=torch.int32).view(b, N + 1)  # every slot kept
    return z, q, batch, tokens, accept_index


def _run(z, q, batch, compute):
    seen = {}

    def eagle_sample(verify_input, batch, logits_output):
        seen["logits"] = logits_output.next_token_logits.clone()  # what sampling saw
        seen["step"] = verify_hooks._step.ctx  # what the kernel hook would mix with
        return "sampled"

    hook = verify_hooks.make_eagle_sample_hook(PluginSettings(enabled=True, default_w=1.0))
    out = SimpleNamespace(next_token_logits=z.clone())
    verify_input = SimpleNamespace(draft_token_num=N + 1, draft_probs=q)
    assert hook(eagle_sample, verify_input, batch, out) == "sampled"
    return out, seen


def _expected(z, q, rows, tokens):
    """`[B, N+1]` log ν(token) at draft slots and log p(token) at the bonus slot."""
    b = len(rows)
    out = torch.empty(b, N + 1)
    for r, (w, greedy, t) in enumerate(rows):
        t = 1.0 if greedy else t
        p = (z.view(b, N + 1, V)[r] / t).softmax(-1)  # [N+1, V]
        for j in range(N + 1):
            dist = w * p[j] + (1 - w) * q[r, j] if j < N else p[j]
            out[r, j] = dist[int(tokens[r * (N + 1) + j])].log()
    return out


@pytest.mark.parametrize(
    "rows",
    [
        [(0.3, False, 0.7), (0.5, True, 1.0), (0.0, False, 1.3)],  # mixed batch
        [(0.25, True, 1.0), (0.8, True, 1.0)],  # all greedy: SGLang uses no temperature
    ],
    ids=["mixed", "all-greedy"],
)
def test_reported_logprobs_are_log_nu_for_greedy_and_sampled_rows(compute_spec_logprobs, rows):
    z, q, batch, tokens, accept_index = _case(rows)
    out, _ = _run(z, q, batch, compute_spec_logprobs)
    compute_spec_logprobs(batch, out, tokens, accept_index=accept_index)
    got = out.next_token_logprobs  # [B, N+1]
    assert torch.allclose(got, _expected(z, q, rows, tokens), atol=1e-4), got


def test_greedy_top_logprob_is_the_token_greedy_emits(compute_spec_logprobs):
    rows = [(0.3, True, 1.0), (0.6, False, 0.9)]
    z, q, batch, tokens, accept_index = _case(rows, seed=3)
    out, _ = _run(z, q, batch, compute_spec_logprobs)
    compute_spec_logprobs(batch, out, tokens, accept_index=accept_index)
    top_idx = out.next_token_top_logprobs_idx  # per (row, slot): top-2 token ids
    p = z.view(2, N + 1, V)[0].softmax(-1)
    emitted = torch.cat([(0.3 * p[:N] + 0.7 * q[0]).argmax(-1), p[N:].argmax(-1)])  # argmax ν, bonus argmax p
    assert [idx[0] for idx in top_idx[: N + 1]] == emitted.tolist()


def test_w1_rows_are_stock(compute_spec_logprobs):
    rows = [(1.0, False, 0.8), (0.4, False, 0.8)]
    z, q, batch, tokens, accept_index = _case(rows, seed=5)
    out, _ = _run(z, q, batch, compute_spec_logprobs)
    stock = SimpleNamespace(next_token_logits=z.clone())
    compute_spec_logprobs(batch, stock, tokens, accept_index=accept_index)
    compute_spec_logprobs(batch, out, tokens, accept_index=accept_index)
    assert torch.equal(out.next_token_logprobs[0], stock.next_token_logprobs[0])  # bit-identical
    assert not torch.allclose(out.next_token_logprobs[1, :N], stock.next_token_logprobs[1, :N])
    assert torch.equal(out.next_token_logprobs[1, N], stock.next_token_logprobs[1, N])  # bonus: p


def test_original_logprob_mode_reports_the_target_and_still_samples_nu(compute_spec_logprobs, monkeypatch):
    """SGLANG_RETURN_ORIGINAL_LOGPROB=1: the operator asked for the target's raw log-probs."""
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    rows = [(0.2, True, 1.0), (0.3, False, 0.7)]
    z, q, batch, tokens, accept_index = _case(rows, seed=7)
    out, seen = _run(z, q, batch, compute_spec_logprobs)
    assert torch.equal(out.next_token_logits, z)  # log-probs come from SGLang's logits, as stock
    step = seen["step"]  # sampling still goes through ν (the kernel hook's step is published)
    assert step is not None and torch.allclose(step.weights, torch.tensor([[0.2] * N, [0.3] * N]))


def test_no_logprobs_requested_leaves_sampled_logits_alone(compute_spec_logprobs):
    rows = [(0.3, False, 0.7)]
    z, q, batch, _, _ = _case(rows)
    batch.return_logprob = False
    out, _ = _run(z, q, batch, compute_spec_logprobs)
    assert torch.equal(out.next_token_logits, z)
