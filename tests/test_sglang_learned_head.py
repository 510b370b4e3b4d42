"""Learned-head mode pieces on CPU: state capture, alignment, the head contract, w per token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.sglang_plugin import hook_specs
from server.sglang_plugin.learned_head import (
    DraftStates,
    HiddenCapture,
    LearnedHead,
    find_final_norm,
    load_head,
    make_load_model_hook,
    run_head,
    target_states,
)
from server.sglang_plugin.params import PluginSettings
from server.sglang_plugin.verify_hooks import row_weights


class ConcatHead(nn.Module):
    """The paper's head shape: linear on concat(h_draft, h_target) (+ the dial) -> sigmoid."""

    def __init__(self, hd: int, ht: int):
        super().__init__()
        self.proj = nn.Linear(hd + ht + 1, 1)

    def forward(self, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor) -> torch.Tensor:
        d = dial.view(-1, 1, 1).expand(-1, h_target.shape[1], 1)
        return torch.sigmoid(self.proj(torch.cat([h_draft, h_target, d], dim=-1))).squeeze(-1)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    return target, draft


def test_capture_sees_the_lm_head_inputs(pair):
    target, _ = pair
    cap = HiddenCapture(find_final_norm(target))
    ids = torch.tensor([[1, 7, 9, 11]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    assert torch.allclose(cap.last, out.hidden_states[-1])  # HF's last state is post-norm
    assert torch.allclose(target.lm_head(cap.last), out.logits, atol=1e-5)
    cap.remove()


def test_find_final_norm_refuses_models_without_one():
    with pytest.raises(ValueError, match="model.norm"):
        find_final_norm(nn.Linear(2, 2))


def test_draft_states_keep_the_last_n_forwards_in_order(pair):
    _, draft = pair
    states = DraftStates(find_final_norm(draft), max_steps=8)
    seqs = torch.tensor([[1, 5], [1, 6]])  # R = 2 requests
    expected = []
    with torch.no_grad():
        for _ in range(4):  # extend pass + 3 decode steps
            out = draft(seqs, output_hidden_states=True)
            expected.append(out.hidden_states[-1][:, -1])
            seqs = torch.cat([seqs, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    h = states.take(rows=2, n=3)
    assert h.shape == (2, 3, draft.config.hidden_size)
    assert torch.allclose(h, torch.stack(expected[-3:], dim=1))
    with pytest.raises(RuntimeError, match="need 9"):
        states.take(rows=2, n=9)


def test_target_states_pick_the_draft_scoring_slots():
    r, n, h = 2, 3, 4
    flat = torch.arange(r * (n + 1) * h + 2 * h, dtype=torch.float32).view(-1, h)  # 2 padding rows
    got = target_states(flat, rows=r, n=n)
    assert got.shape == (r, n, h)
    assert torch.equal(got[1, 0], flat[n + 1]) and torch.equal(got[0, n - 1], flat[n - 1])


def test_run_head_contract():
    h_d, h_t, dial = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.tensor([0.2, 0.9])
    assert torch.equal(run_head(lambda a, b, c: torch.full((2, 3), 1.7), h_d, h_t, dial), torch.ones(2, 3))
    nan = run_head(lambda a, b, c: torch.full((2, 3), float("nan")), h_d, h_t, dial)
    assert torch.equal(nan, torch.ones(2, 3))  # NaN degrades to lossless, never crashes a batch
    with pytest.raises(ValueError, match="must return"):
        run_head(lambda a, b, c: torch.ones(2), h_d, h_t, dial)
    with pytest.raises(ValueError, match="disagree"):
        run_head(lambda a, b, c: torch.ones(2, 3), h_d[:1], h_t, dial)


def test_torchscript_head_end_to_end_through_the_load_model_hook(pair, tmp_path):
    target, draft = pair
    head = ConcatHead(draft.config.hidden_size, target.config.hidden_size)
    path = tmp_path / "head.pt"
    torch.jit.save(torch.jit.script(head), str(path))
    learned = LearnedHead(load_head(str(path)))
    hook = make_load_model_hook(learned)
    hook(None, SimpleNamespace(model=target, is_draft_worker=False))
    hook(None, SimpleNamespace(model=draft, is_draft_worker=True))
    n, rows = 2, 2
    with torch.no_grad():
        for _ in range(n):  # draft forwards producing drafts 1..N
            draft(torch.tensor([[1, 5], [1, 6]]))
        target(torch.randint(0, 50, (1, rows * (n + 1))))  # flat verify forward, R*(N+1) tokens
    w = learned.weights(torch.tensor([0.3, 0.8]), num_draft=n)
    assert w.shape == (rows, n) and bool(((w >= 0) & (w <= 1)).all())
    # Same numbers as calling the head on the captured states directly.
    h_t = target_states(learned.target.last, rows, n)
    h_d = learned.draft.take(rows, n)
    assert torch.allclose(w, head(h_d, h_t, torch.tensor([0.3, 0.8])), atol=1e-6)


def test_row_weights_mix_learned_and_static_rows():
    def req(cp):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=cp))

    batch = SimpleNamespace(reqs=[req({"dialspec_w": 0.4}), req({"dialspec_w": 0.6, "dialspec_dial": 0.6})])
    head = SimpleNamespace(weights=lambda dial, n: torch.full((2, n), 0.05))
    settings = PluginSettings(enabled=True, default_w=1.0)
    w = row_weights(batch, settings, torch.device("cpu"), num_draft=3, head=head)
    assert torch.allclose(w, torch.tensor([[0.4] * 3, [0.05] * 3]))
    static = row_weights(batch, settings, torch.device("cpu"), num_draft=3, head=None)
    assert torch.allclose(static, torch.tensor([0.4, 0.6]))


def test_project_head_directory_loads(pair, tmp_path):
    from server.engine.head_store import save_head

    target, draft = pair
    saved = save_head(head_for_pair_sizes(draft, target), tmp_path / "head")
    head = load_head(str(saved))
    h_d, h_t = torch.randn(2, 3, draft.config.hidden_size), torch.randn(2, 3, target.config.hidden_size)
    w = run_head(head, h_d, h_t, torch.tensor([0.1, 0.9]))
    assert torch.allclose(w, torch.full((2, 3), 0.5))  # a fresh head starts at w = 0.5


def head_for_pair_sizes(draft, target):
    from verifier.head import HeadConfig, WeightHead

    return WeightHead(
        HeadConfig(draft_hidden=draft.config.hidden_size, target_hidden=target.config.hidden_size)
    )


def test_head_path_adds_the_model_load_hook(tmp_path):
    path = tmp_path / "h.pt"
    torch.jit.save(torch.jit.script(ConcatHead(2, 2)), str(path))
    specs = hook_specs(PluginSettings(enabled=True, head_path=str(path)))
    assert specs[0][0].endswith("ModelRunner.load_model") and specs[0][2] == "AFTER"
