"""A batch whose every row is w = 1 takes SGLang 0.5.23's stock path, untouched.

Checked on what runs, not on what the code says: SGLang's real `eagle_sample` (stand-ins of
tests/sglang_eagle_cpu.py) and SGLang's chain kernel (Triton, interpreted) are run once bare and
once through the plugin's hooks on identical inputs and seeds; a profiler records every Python
function called. For all-w = 1 batches the SGLang functions called, in order, are the same, the
outputs and the logits are bit-identical, and no ν code runs. The decision is made on the host,
from the requests' `custom_params`, before anything touches the device (tests/test_sglang_hot_path.py
shows the step copies nothing there).

The draft side: the draft hook hands SGLang's `draft` an all-greedy all-w = 1 batch with
`is_all_greedy` still True, so `draft_forward` skips q (its fast top-1 path) and SGLang's own
`EAGLEDraftCudaGraphRunner._sampling_variant` picks the greedy graph; with a w < 1 row the flag is
down during the draft (q is built, the sampled graph replays) and restored after.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from server.sglang_plugin import verify_hooks
from server.sglang_plugin.params import PluginSettings
from tests import sglang_eagle_cpu as sgl_eagle
from tests.sglang_kernel import load_chain_kernel

N, V = 2, 12
SETTINGS = PluginSettings(enabled=True, default_w=1.0)


@pytest.fixture(scope="module")
def kernel():
    return load_chain_kernel(interpret=True).chain_speculative_sampling_triton


def _trace(fn):
    """Run fn; return its result and the (file, function) of every Python call it made."""
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append((frame.f_code.co_filename, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


def _sglang(calls):
    return [c for c in calls if "/sglang/" in c[0] and "/triton/" not in c[0]]


def _run(rows, kernel, monkeypatch, hooked: bool, seed: int = 3):
    """One verify step of real eagle_sample; rows: (temperature, custom_params)."""
    g = torch.Generator().manual_seed(seed)
    b = len(rows)
    reqs = [sgl_eagle.Req(f"r{i}", V, temperature=t, custom_params=cp) for i, (t, cp) in enumerate(rows)]
    batch = sgl_eagle.Batch(reqs, V, return_logprob=True)
    logits = torch.randn(b * (N + 1), V, generator=g)
    q = torch.softmax(torch.randn(b, N, V, generator=g), -1)
    cand = torch.cat(
        [torch.zeros(b, 1, dtype=torch.long), torch.multinomial(q.view(-1, V), 1, generator=g).view(b, N)], 1
    )
    out = SimpleNamespace(next_token_logits=logits)
    verify_input = sgl_eagle.verify_input(cand, q)
    eagle_sample = sgl_eagle.modules().eagle_utils.eagle_sample
    if hooked:  # as SGLang's HookRegistry wires them: AROUND the real function and the real kernel
        sgl_eagle.stand_in_platform(monkeypatch, lambda **kw: verify_hooks.chain_kernel_around(kernel, **kw))
        hook = verify_hooks.make_eagle_sample_hook(SETTINGS)
        call = lambda: hook(eagle_sample, verify_input, batch, out)  # noqa: E731
    else:
        sgl_eagle.stand_in_platform(monkeypatch, kernel)
        call = lambda: eagle_sample(verify_input, batch, out)  # noqa: E731
    eu = sgl_eagle.modules().eagle_utils
    greedy_real, seen = eu.verify_tree_greedy_func, {}

    def greedy_verify(**kw):  # SGLang's greedy commit; its CPU op leaves outputs unset here
        seen["target_predict"] = kw["target_predict"].clone()
        return greedy_real(**kw)

    monkeypatch.setattr(eu, "verify_tree_greedy_func", greedy_verify)
    torch.manual_seed(seed)  # eagle_sample's coins
    result, calls = _trace(call)
    if "target_predict" in seen:
        result = (seen["target_predict"],)  # what the greedy branch commits from
    return result, out.next_token_logits, calls, batch


ALL_W1 = {
    "sampled": [(0.8, {"dialspec_w": 1.0}), (1.0, None), (1.3, {"dialspec_mode": "autoregressive"})],
    "greedy": [(0.0, {"dialspec_w": 1.0}), (0.0, None)],
    "mixed": [(0.0, None), (0.9, {"dialspec_w": 1.0})],
}


@pytest.mark.parametrize("kind", list(ALL_W1))
def test_all_w1_batches_run_exactly_sglangs_functions(kind, kernel, monkeypatch):
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    _run(ALL_W1[kind], kernel, monkeypatch, hooked=False)  # first calls import and compile
    stock, stock_logits, stock_calls, _ = _run(ALL_W1[kind], kernel, monkeypatch, hooked=False)
    ours, our_logits, our_calls, batch = _run(ALL_W1[kind], kernel, monkeypatch, hooked=True)
    assert _sglang(our_calls) == _sglang(stock_calls)  # same functions, same order
    ran = {name for path, name in our_calls if "/server/sglang_plugin/" in path}
    assert not {n for n in ran if n.startswith(("nu_", "_masked", "_softmax", "VerifyStep"))}, ran
    for a, b in zip(ours, stock, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(our_logits, stock_logits)
    greedy_branch = {"greedy_verify"} & {n.split(".")[-1] for _, n in stock_calls}
    assert bool(greedy_branch) == (kind == "greedy")  # SGLang's greedy fast path for all-greedy


def test_a_w_below_1_row_takes_the_nu_path(kernel, monkeypatch):
    """The other side of the decision: one row at w < 1 and the step goes through ν."""
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    rows = [(0.0, None), (0.9, {"dialspec_w": 0.5})]
    _, _, calls, batch = _run(rows, kernel, monkeypatch, hooked=True)
    names = {n.split(".")[-1] for _, n in calls}
    assert "nu_into_target_probs_" in names and "nu_logprob_logits_" in names
    assert "greedy_verify" not in names
    assert batch.sampling_info.is_all_greedy is False  # mixed batch: never flipped


def test_draft_hook_leaves_all_w1_greedy_batches_on_the_greedy_graph(monkeypatch):
    from tests.sglang_cpu import import_heavy

    sgl_eagle.modules()  # SGLang's heavy modules first, in their import order

    graph = import_heavy(["sglang.srt.speculative.eagle_draft_cuda_graph_runner"])[
        "sglang.srt.speculative.eagle_draft_cuda_graph_runner"
    ]
    monkeypatch.setattr(graph, "get_spec", lambda: SimpleNamespace(speculative_use_rejection_sampling=True))
    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    hook = verify_hooks.make_draft_hook(SETTINGS)

    def draft(worker, batch):  # what EagleDraftWorker.draft hands its ForwardBatch
        forward_batch = SimpleNamespace(sampling_info=batch.sampling_info)
        return batch.sampling_info.is_all_greedy, graph.EAGLEDraftCudaGraphRunner._sampling_variant(
            None, forward_batch
        )

    def reqs(*w):
        return [
            sgl_eagle.Req(f"r{i}", V, temperature=0.0, custom_params={"dialspec_w": x})
            for i, x in enumerate(w)
        ]

    stock = sgl_eagle.Batch(reqs(1.0, 1.0), V)
    assert hook(draft, None, stock) == (True, graph._GREEDY_VARIANT)  # top-1 path, greedy graph
    lossy = sgl_eagle.Batch(reqs(1.0, 0.5), V)
    assert hook(draft, None, lossy) == (False, None)  # q built, sampled graph
    assert lossy.sampling_info.is_all_greedy is True  # restored
