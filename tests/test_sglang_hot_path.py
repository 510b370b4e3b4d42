"""The plugin's verify step never makes the host wait for the device (tests/sync_detector.py).

Every hook body of a verify step runs under the detector, around SGLang's real `eagle_sample`
(tests/sglang_eagle_cpu.py; SGLang's own code is exempt, the hooks are not): the draft hook, the
eagle_sample hook, the kernel hook inside it, the log-prob rewrite and, with a learned head, the
capture hook around every model forward. Batches of every kind, with and without a head and
log-probs, over two steps: the first sees a new batch (one non-blocking upload of the rows'
parameters is allowed), the second the same batch (no copy at all).

"Device" is torch's `meta` device here (no data: a host read cannot even pretend to work) and
CUDA under `scripts/gpu_smoke.sh` (DIALSPEC_TEST_DEVICE=cuda), where the step also runs under
`torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from server.sglang_plugin import verify_hooks
from server.sglang_plugin.learned_head import LearnedHead, make_forward_hook, make_load_model_hook
from server.sglang_plugin.params import PluginSettings
from tests import sglang_eagle_cpu as sgl_eagle
from tests.device import DEVICE
from tests.sync_detector import HostSync, SyncDetector

DEV = DEVICE if DEVICE.type == "cuda" else torch.device("meta")
N, V, HD, HT = 3, 40, 4, 6
SETTINGS = PluginSettings(enabled=True, default_w=1.0)

# (w, greedy) per row; w None = the request sends no w (server default 1).
BATCHES = {
    "all-w1-greedy": [(1.0, True), (None, True), (1.0, True)],
    "all-sampled": [(0.5, False), (0.0, False), (0.25, False)],
    "mixed-w": [(1.0, False), (0.3, False), (0.8, False), (None, False)],
    "mixed-greedy-sampled": [(0.4, True), (1.0, False), (0.6, False), (0.0, True)],
    "all-greedy-w-below-1": [(0.5, True), (0.0, True)],
}


class ConcatHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HD + HT + 1, 1)

    def forward(self, h_draft, h_target, dial):
        d = dial.view(-1, 1, 1).expand(-1, h_target.shape[1], 1)
        return torch.sigmoid(self.proj(torch.cat([h_draft, h_target, d], dim=-1))).squeeze(-1)


class FlatModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.norm = nn.Identity()


def _reqs(rows, learned: bool):
    out = []
    for i, (w, greedy) in enumerate(rows):
        params = {} if w is None else {"dialspec_w": w}
        if learned and i % 2 == 0 and w is not None:
            params["dialspec_dial"] = w
        out.append(sgl_eagle.Req(f"r{i}", V, temperature=0.0 if greedy else 0.9, custom_params=params))
    return out


@contextlib.contextmanager
def _resumed(det: SyncDetector):
    paused, det.paused = det.paused, 0
    try:
        yield
    finally:
        det.paused = paused


class Step:
    """One scheduler iteration of a STANDALONE worker, hooks under the detector."""

    def __init__(self, rows, *, head: bool, logprob: bool, monkeypatch):
        monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
        monkeypatch.setattr(verify_hooks, "_original_logprobs_requested", lambda: False)
        self.det = SyncDetector()
        self.kernel_calls = 0

        def kernel(**kw):  # the chain kernel is SGLang's: exempt, but its hook is watched
            with _resumed(self.det):
                return verify_hooks.chain_kernel_around(self._count, **kw)

        sgl_eagle.stand_in_platform(monkeypatch, kernel)
        self.learned = LearnedHead(ConcatHead().to(DEV)) if head else None
        self.planner = verify_hooks.StepPlanner(SETTINGS, self.learned)
        self.sample_hook = verify_hooks.make_eagle_sample_hook(SETTINGS, self.learned, self.planner)
        self.draft_hook = verify_hooks.make_draft_hook(SETTINGS, self.learned, self.planner)
        self.reqs = _reqs(rows, learned=head)
        self.batch = sgl_eagle.Batch(self.reqs, V, return_logprob=logprob, device=str(DEV))
        if head:
            self.forward_hook = make_forward_hook(self.learned)
            self.runners = {d: SimpleNamespace(model=FlatModel(), is_draft_worker=d) for d in (True, False)}
            for runner in self.runners.values():
                make_load_model_hook(self.learned)(None, runner)

    def _count(self, **kw):
        with self.det.pause():
            self.kernel_calls += 1

    def _forward(self, is_draft: bool, mode: str, rows: int, width: int, **fields):
        b = len(self.reqs)
        fb = SimpleNamespace(
            forward_mode=SimpleNamespace(name=mode), rids=[r.rid for r in self.reqs],
            seq_lens=torch.full((b,), 9, device=DEV), **fields,
        )  # fmt: skip
        states = torch.zeros(rows, width, device=DEV)

        def model_forward(runner, forward_batch):
            with self.det.pause():
                return runner.model.model.norm(states)

        self.forward_hook(model_forward, self.runners[is_draft], fb)

    def _capture(self, first: bool):
        b = len(self.reqs)
        if first:
            lens = torch.full((b,), 5, device=DEV)
            self._forward(True, "EXTEND", 5 * b, HD, extend_seq_lens=lens, extend_seq_lens_cpu=[5] * b)
        else:
            spec = SimpleNamespace(num_accept_tokens=torch.full((b,), 2, device=DEV), num_front_tokens=0)
            lens = torch.full((b,), N + 1, device=DEV)
            self._forward(
                True, "DRAFT_EXTEND_V2", (N + 1) * b, HD, extend_seq_lens=lens,
                extend_seq_lens_cpu=[N + 1] * b, spec_info=spec,
            )  # fmt: skip
        for _ in range(N - 1):
            self._forward(True, "DECODE", b, HD)
        self._forward(False, "TARGET_VERIFY", (N + 1) * b + 2, HT)

    def run(self, first: bool) -> None:
        b = len(self.reqs)
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(b * (N + 1), V, generator=g).to(DEV)  # [B·(N+1), V]
        q = torch.softmax(torch.randn(b, N, V, generator=g), -1).to(DEV)  # [B, N, V]
        cand = torch.zeros(b, N + 1, dtype=torch.long, device=DEV)
        verify_input = sgl_eagle.verify_input(cand, q)
        out = SimpleNamespace(next_token_logits=logits)
        self.det.uploads = first
        self.det.uploaded = 0
        debug = torch.cuda.set_sync_debug_mode if DEV.type == "cuda" else None
        if debug:
            debug("error")
        try:
            with self.det:
                if self.learned is not None:
                    self._capture(first)
                self.draft_hook(self._draft, None, self.batch)
                self.sample_hook(self._eagle_sample, verify_input, self.batch, out)
        finally:
            if debug:
                debug("default")

    def _draft(self, worker, batch):
        with self.det.pause():
            self.draft_saw_all_greedy = batch.sampling_info.is_all_greedy

    def _eagle_sample(self, *args, **kwargs):
        with self.det.pause():
            return sgl_eagle.modules().eagle_utils.eagle_sample(*args, **kwargs)


@pytest.mark.parametrize("logprob", [False, True], ids=["no-logprob", "logprob"])
@pytest.mark.parametrize("head", [False, True], ids=["static", "head"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_a_verify_step_never_waits_for_the_device(kind, head, logprob, monkeypatch):
    step = Step(BATCHES[kind], head=head, logprob=logprob, monkeypatch=monkeypatch)
    step.run(first=True)
    stock = step.planner.plan(step.reqs).stock
    assert step.det.uploaded == (0 if stock else 1)  # the rows' parameters, once per batch
    step.run(first=False)
    assert step.det.uploaded == 0
    assert step.kernel_calls == (0 if stock and all(g for _, g in BATCHES[kind]) else 2)


def test_the_detector_catches_each_way_to_wait_for_the_device():
    """The detector is not vacuous: each pattern the issue names (and the old hook used) fails."""
    x = torch.randn(4, 5, device=DEV)
    mask = torch.ones(4, 5, dtype=torch.bool, device=DEV)
    patterns = {
        "bool(x.any())": lambda: bool(x.any()),
        ".item()": lambda: x.sum().item(),
        "if tensor": lambda: 1 if (x > 0).all() else 0,
        ".nonzero()": lambda: x.nonzero(),
        "torch.equal": lambda: torch.equal(x, x),
        "boolean-mask index": lambda: x[mask],
        ".tolist()": lambda: x.tolist(),
        ".cpu()": lambda: x.cpu(),
        ".cpu().numpy()": lambda: x.cpu().numpy(),
        "torch.tensor(list, device=)": lambda: torch.tensor([1.0, 2.0], device=DEV),
        "torch.tensor([device values])": lambda: torch.tensor([x[0, 0], x[1, 1]]),
        "upload in a steady step": lambda: torch.ones(2).to(DEV, non_blocking=True),
        "repeat_interleave(tensor)": lambda: x.repeat_interleave(
            torch.ones(4, dtype=torch.long, device=DEV), 0
        ),
    }
    for name, pattern in patterns.items():
        with pytest.raises(HostSync), SyncDetector():
            pattern()
        assert name
    with SyncDetector(uploads=True) as det:  # a batch change may upload, non-blocking
        torch.ones(2).to(DEV, non_blocking=True)
        with pytest.raises(HostSync, match="blocking"):
            torch.ones(2).to(DEV)
    assert det.uploaded == 1
