"""Learned-head mode on CPU: capture, SGLang's flat batch layouts, per-request alignment, fallbacks.

The layout tests drive `LearnedHead` exactly as SGLang 0.5.23 would in a STANDALONE server with
CUDA graphs off: real `ForwardBatch` / `ForwardMode` / `EagleDraftExtendInput` / `ScheduleBatch`
/ `Req` objects (imported with the stand-in torchvision of tests/sglang_cpu.py), flat `[T, H]`
norm outputs laid out as `hidden_layout` documents, and the call order of
`EAGLEWorkerV2.forward_batch_generation`: draft extend (prefill or after a verify), N − 1 draft
decode steps, target verify. Every hidden row carries its own coordinates
`(request, forward, row)`, so each test asserts which rows the head saw.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.sglang_plugin import LOAD_MODEL, MODEL_FORWARD, hook_specs
from server.sglang_plugin.hidden_layout import APPEND, RESET, DraftChains, draft_rows, verify_rows
from server.sglang_plugin.learned_head import (
    HiddenCapture,
    LearnedHead,
    find_final_norm,
    load_head,
    make_forward_hook,
    make_load_model_hook,
    run_head,
)
from server.sglang_plugin.params import PluginSettings
from server.sglang_plugin.verify_hooks import row_weights
from tests.sglang_cpu import import_heavy

N = 3  # draft length in the layout tests
HD, HT = 3, 4  # hidden sizes: (request code, forward id, row) [+ a target marker]


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


def test_run_head_contract():
    h_d, h_t, dial = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.tensor([0.2, 0.9])
    assert torch.equal(run_head(lambda a, b, c: torch.full((2, 3), 1.7), h_d, h_t, dial), torch.ones(2, 3))
    nan = run_head(lambda a, b, c: torch.full((2, 3), float("nan")), h_d, h_t, dial)
    assert torch.equal(nan, torch.ones(2, 3))  # NaN degrades to lossless, never crashes a batch
    with pytest.raises(ValueError, match="must return"):
        run_head(lambda a, b, c: torch.ones(2), h_d, h_t, dial)
    with pytest.raises(ValueError, match="disagree"):
        run_head(lambda a, b, c: torch.ones(2, 3), h_d[:1], h_t, dial)


def test_row_weights_pass_the_dial_of_learned_rows_and_keep_static_w_elsewhere():
    """A learned row's head input is its dial (not its static w); other rows keep their w."""

    def req(rid, cp):
        return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=cp))

    seen = {}

    def weights(rids, dial, n):
        seen["rids"], seen["dial"] = list(rids), dial.clone()
        return torch.full((len(rids), n), 0.05), [True] * len(rids)

    batch = SimpleNamespace(
        reqs=[req("a", {"dialspec_w": 0.4}), req("b", {"dialspec_w": 0.9, "dialspec_dial": 0.6})]
    )
    head = SimpleNamespace(weights=weights, log=SimpleNamespace(warn=lambda *a: None))
    settings = PluginSettings(enabled=True, default_w=1.0)
    w = row_weights(batch, settings, torch.device("cpu"), num_draft=3, head=head)
    assert torch.allclose(w, torch.tensor([[0.4] * 3, [0.05] * 3]))
    assert seen["rids"] == ["a", "b"] and torch.allclose(seen["dial"][1], torch.tensor(0.6))
    static = row_weights(batch, settings, torch.device("cpu"), num_draft=3, head=None)
    assert torch.allclose(static, torch.tensor([[0.4] * 3, [0.9] * 3]))


def test_project_head_directory_loads(pair, tmp_path):
    from server.engine.head_store import save_head

    target, draft = pair
    saved = save_head(head_for_pair_sizes(draft, target), tmp_path / "head")
    head = load_head(str(saved))
    h_d, h_t = torch.randn(2, 3, draft.config.hidden_size), torch.randn(2, 3, target.config.hidden_size)
    w = run_head(head, h_d, h_t, torch.tensor([0.1, 0.9]))
    assert torch.allclose(w, torch.full((2, 3), 0.5))  # a fresh head starts at w = 0.5


def test_heads_that_read_position_stats_are_refused_at_load(pair, tmp_path):
    """The plugin has no p and q per draft position for the head: refuse, never run without them."""
    from server.engine.head_store import save_head

    target, draft = pair
    saved = save_head(head_for_pair_sizes(draft, target, inputs="both"), tmp_path / "head")
    with pytest.raises(ValueError, match="head_inputs=states"):
        load_head(str(saved))


def head_for_pair_sizes(draft, target, inputs="states"):
    from verifier.head import HeadConfig, WeightHead

    return WeightHead(
        HeadConfig(
            draft_hidden=draft.config.hidden_size, target_hidden=target.config.hidden_size, inputs=inputs
        )
    )


@pytest.fixture(scope="module")
def sgl():
    mods = import_heavy(
        [
            "sglang.srt.model_executor.forward_batch_info",
            "sglang.srt.speculative.eagle_info",
            "sglang.srt.managers.schedule_batch",
        ]
    )
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(
        fbi=mods["sglang.srt.model_executor.forward_batch_info"],
        eagle_info=mods["sglang.srt.speculative.eagle_info"],
        sb=mods["sglang.srt.managers.schedule_batch"],
        SamplingParams=SamplingParams,
    )


CODES = {"a": 1.0, "b": 2.0, "c": 3.0}


class FlatModel(nn.Module):
    """Stands in for an SGLang model: `.model.norm` sees the flat `[T, H]` hidden states."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.norm = nn.Identity()


class Sim:
    """Runs forwards through `make_forward_hook` the way SGLang's workers call ModelRunner.forward."""

    def __init__(self, sgl, head: LearnedHead):
        self.sgl, self.head, self.fid = sgl, head, 0
        self.hook = make_forward_hook(head)
        self.draft = SimpleNamespace(model=FlatModel(), is_draft_worker=True)
        self.target = SimpleNamespace(model=FlatModel(), is_draft_worker=False)
        load = make_load_model_hook(head)
        load(None, self.draft)
        load(None, self.target)

    def _states(self, owners: list[str], width: int) -> torch.Tensor:
        """`[T, width]`: row t = (code of its request, forward id, t, [target marker])."""
        rows = [
            [CODES.get(o, 0.0), float(self.fid), float(t)] + [9.0] * (width - 3) for t, o in enumerate(owners)
        ]
        return torch.tensor(rows)

    def forward(self, runner, forward_batch, owners: list[str], width: int, replay_graph: bool = False):
        self.fid += 1
        states = self._states(owners, width)

        def model_runner_forward(runner, fb):
            if not replay_graph:  # a CUDA-graph replay would not run the norm module in Python
                runner.model.model.norm(states)
            return "logits"

        assert self.hook(model_runner_forward, runner, forward_batch) == "logits"
        return self.fid

    def batch(self, mode: str, rids: list[str], **kw):
        fbi = self.sgl.fbi
        b = len(rids)
        t = sum(kw.get("extend_seq_lens_cpu") or [1] * b)
        return fbi.ForwardBatch(
            forward_mode=getattr(fbi.ForwardMode, mode),
            batch_size=b,
            input_ids=torch.zeros(t, dtype=torch.long),
            req_pool_indices=torch.arange(b),
            seq_lens=torch.full((b,), 10),
            out_cache_loc=torch.zeros(t, dtype=torch.long),
            seq_lens_sum=10 * b,
            rids=list(rids),
            **kw,
        )

    # -- SGLang's forwards -----------------------------------------------------------------
    def prefill_draft_extend(self, rids, lens):
        fb = self.batch("EXTEND", rids, extend_seq_lens=torch.tensor(lens), extend_seq_lens_cpu=list(lens))
        owners = [rid for rid, n in zip(rids, lens, strict=True) for _ in range(n)]
        return self.forward(self.draft, fb, owners, HD)

    def draft_decode(self, rids, replay_graph=False):
        return self.forward(self.draft, self.batch("DECODE", rids), list(rids), HD, replay_graph)

    def verify(self, rids, pad=2):
        owners = [rid for rid in rids for _ in range(N + 1)] + ["pad"] * pad
        return self.forward(self.target, self.batch("TARGET_VERIFY", rids), owners, HT)

    def draft_extend_after_verify(self, rids, accept):
        spec = self.sgl.eagle_info.EagleDraftExtendInput(
            num_accept_tokens=torch.tensor(accept), num_tokens_per_req=N + 1
        )
        w = [N + 1] * len(rids)
        fb = self.batch(
            "DRAFT_EXTEND_V2", rids, extend_seq_lens=torch.tensor(w), extend_seq_lens_cpu=w, spec_info=spec
        )
        owners = [rid for rid in rids for _ in range(N + 1)]
        return self.forward(self.draft, fb, owners, HD)

    def schedule_batch(self, rows: list[tuple[str, dict]]):
        reqs = []
        for rid, cp in rows:
            sp = self.sgl.SamplingParams(temperature=1.0, custom_params=cp)
            sp.normalize(None)
            reqs.append(self.sgl.sb.Req(rid, "", [1, 2, 3], sp))
        return self.sgl.sb.ScheduleBatch(reqs=reqs, device="cpu")


class RecordingHead(nn.Module):
    """Returns w = 0.25 everywhere and remembers what it was given."""

    def forward(self, h_draft, h_target, dial):
        self.seen = (h_draft.clone(), h_target.clone(), dial.clone())
        return torch.full(h_target.shape[:2], 0.25)


def _coords(h: torch.Tensor) -> list[tuple[int, int, int]]:
    """`(request code, forward id, row)` of each `[H]` state in `[N, H]`."""
    return [tuple(int(x) for x in v[:3]) for v in h]


SETTINGS = PluginSettings(enabled=True, default_w=1.0)


def _rows(layout):
    kind, rows = layout
    return kind, rows.tolist()


def test_draft_rows_follow_sglang_layouts(sgl):
    sim = Sim(sgl, LearnedHead(RecordingHead()))
    ext = sim.batch("EXTEND", ["a", "b"], extend_seq_lens=torch.tensor([3, 5]), extend_seq_lens_cpu=[3, 5])
    assert _rows(draft_rows(ext)) == (RESET, [2, 7])  # last prefill token of each request
    spec = sgl.eagle_info.EagleDraftExtendInput(
        num_accept_tokens=torch.tensor([2, 4]), num_tokens_per_req=N + 1
    )
    dev2 = sim.batch(
        "DRAFT_EXTEND_V2",
        ["a", "b"],
        extend_seq_lens=torch.tensor([4, 4]),
        extend_seq_lens_cpu=[4, 4],
        spec_info=spec,
    )
    assert _rows(draft_rows(dev2)) == (RESET, [1, 7])  # r(N+1) + accept − 1: the bonus token's row
    spec.num_front_tokens = 2  # a widened window puts `front` rows before the verified ones
    w = [N + 3, N + 3]
    dev2w = sim.batch(
        "DRAFT_EXTEND_V2", ["a", "b"], extend_seq_lens=torch.tensor(w), extend_seq_lens_cpu=w, spec_info=spec
    )
    assert _rows(draft_rows(dev2w)) == (RESET, [3, 11])
    assert _rows(draft_rows(sim.batch("DECODE", ["a", "b"]))) == (APPEND, [0, 1])
    assert draft_rows(sim.batch("IDLE", [])) is None
    with pytest.raises(ValueError, match="MIXED"):
        draft_rows(sim.batch("MIXED", ["a"], extend_seq_lens=torch.tensor([2]), extend_seq_lens_cpu=[2]))
    assert verify_rows(2, N).tolist() == [[0, 1, 2], [4, 5, 6]]


def test_states_follow_requests_through_joins_leaves_and_reorders(sgl):
    head = RecordingHead()
    learned = LearnedHead(head)
    sim = Sim(sgl, learned)
    # Round 1: a and b prefilled together, N − 1 draft steps, verify.
    f_ext = sim.prefill_draft_extend(["a", "b"], [3, 5])
    f_d1, f_d2 = sim.draft_decode(["a", "b"]), sim.draft_decode(["a", "b"])
    f_v = sim.verify(["a", "b"])
    batch = sim.schedule_batch([("a", {"dialspec_w": 0.4, "dialspec_dial": 0.4}), ("b", {"dialspec_w": 0.6})])
    w = row_weights(batch, SETTINGS, torch.device("cpu"), N, learned)
    assert torch.allclose(w, torch.tensor([[0.25] * N, [0.6] * N]))  # b did not ask: its static w
    h_d, h_t, dial = head.seen
    assert _coords(h_d[0]) == [(1, f_ext, 2), (1, f_d1, 0), (1, f_d2, 0)]
    assert _coords(h_d[1]) == [(2, f_ext, 7), (2, f_d1, 1), (2, f_d2, 1)]
    assert _coords(h_t[0]) == [(1, f_v, 0), (1, f_v, 1), (1, f_v, 2)]  # slots scoring drafts 1..N
    assert _coords(h_t[1]) == [(2, f_v, 4), (2, f_v, 5), (2, f_v, 6)]
    assert h_t.shape == (2, N, HT) and torch.allclose(dial, torch.tensor([0.4, 0.6]))

    # After the verify: draft extend (a accepted 1 draft, b all 3), then c joins (prefill),
    # b leaves, and the next decode batch is ordered [c, a].
    f_x = sim.draft_extend_after_verify(["a", "b"], accept=[2, 4])
    f_c = sim.prefill_draft_extend(["c"], [4])
    g_d1, g_d2 = sim.draft_decode(["c", "a"]), sim.draft_decode(["c", "a"])
    g_v = sim.verify(["c", "a"])
    batch = sim.schedule_batch(
        [("c", {"dialspec_dial": 1.0}), ("a", {"dialspec_w": 0.4, "dialspec_dial": 0.4})]
    )
    w = row_weights(batch, SETTINGS, torch.device("cpu"), N, learned)
    assert torch.allclose(w, torch.full((2, N), 0.25))
    h_d, h_t, _ = head.seen
    assert _coords(h_d[0]) == [(3, f_c, 3), (3, g_d1, 0), (3, g_d2, 0)]
    assert _coords(h_d[1]) == [(1, f_x, 1), (1, g_d1, 1), (1, g_d2, 1)]  # row 0·(N+1) + 2 − 1
    assert _coords(h_t[0]) == [(3, g_v, 0), (3, g_v, 1), (3, g_v, 2)]
    assert _coords(h_t[1]) == [(1, g_v, 4), (1, g_v, 5), (1, g_v, 6)]


def test_a_request_that_left_ages_out():
    chains = DraftChains(max_age=2)
    chains.record(RESET, ["a", "b"], torch.zeros(2, HD), torch.tensor([0, 1]))
    for _ in range(3):
        chains.advance()
        chains.record(APPEND, ["a"], torch.zeros(1, HD), torch.tensor([0]))
    assert len(chains) == 1 and chains.take(["b"], 1)[1] == [False]


def test_forward_without_captured_states_falls_back_to_static_w(sgl, caplog):
    learned = LearnedHead(RecordingHead())
    sim = Sim(sgl, learned)
    sim.prefill_draft_extend(["a", "b"], [2, 2])
    sim.draft_decode(["a", "b"])
    sim.draft_decode(["a", "b"], replay_graph=True)  # no Python hooks ran: both chains dropped
    sim.verify(["a", "b"])
    batch = sim.schedule_batch(
        [
            ("a", {"dialspec_w": 0.3, "dialspec_dial": 0.3}),
            ("b", {"dialspec_w": 0.7, "dialspec_dial": 0.7}),
        ]
    )
    with caplog.at_level(logging.WARNING):
        w = row_weights(batch, SETTINGS, torch.device("cpu"), N, learned)
    assert torch.allclose(w, torch.tensor([[0.3] * N, [0.7] * N]))
    assert "captured no states" in caplog.text and "static w used" in caplog.text


def test_head_errors_and_misaligned_batches_fall_back_to_static_w(sgl, caplog):
    class Broken(nn.Module):
        def forward(self, h_draft, h_target, dial):
            raise RuntimeError("head exploded")

    learned = LearnedHead(Broken())
    sim = Sim(sgl, learned)
    sim.prefill_draft_extend(["a"], [2])
    sim.draft_decode(["a"])
    sim.draft_decode(["a"])
    sim.verify(["a"])
    batch = sim.schedule_batch([("a", {"dialspec_w": 0.2, "dialspec_dial": 0.2})])
    with caplog.at_level(logging.WARNING):
        w = row_weights(batch, SETTINGS, torch.device("cpu"), N, learned)
    assert torch.allclose(w, torch.full((1, N), 0.2)) and "head exploded" in caplog.text

    learned.head = RecordingHead()
    other = sim.schedule_batch([("z", {"dialspec_w": 0.2, "dialspec_dial": 0.2})])  # not the verified rids
    w, ok = learned.weights(["z"], torch.tensor([0.2]), N)
    assert not any(ok)
    assert torch.allclose(
        row_weights(other, SETTINGS, torch.device("cpu"), N, learned), torch.full((1, N), 0.2)
    )

    mixed = sim.batch("MIXED", ["a"], extend_seq_lens=torch.tensor([2]), extend_seq_lens_cpu=[2])
    sim.forward(sim.draft, mixed, ["a", "a"], HD)  # a layout the head refuses: a's chain is dropped
    assert learned.chains.take(["a"], N)[1] == [False]


def test_learned_w_reaches_the_kernel_per_token(sgl, monkeypatch):
    """Through the eagle_sample hook: the learned row's ν uses w_t per slot, the other its static w."""
    from server.sglang_plugin import verify_hooks

    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    learned = LearnedHead(RecordingHead())
    sim = Sim(sgl, learned)
    sim.prefill_draft_extend(["a", "b"], [2, 3])
    sim.draft_decode(["a", "b"])
    sim.draft_decode(["a", "b"])
    sim.verify(["a", "b"])
    batch = sim.schedule_batch([("a", {"dialspec_w": 0.9, "dialspec_dial": 0.9}), ("b", {"dialspec_w": 0.5})])
    batch.forward_mode = sgl.fbi.ForwardMode.DECODE
    batch.sampling_info = SimpleNamespace(is_all_greedy=False, logit_bias=None)
    batch.return_logprob = False
    g = torch.Generator().manual_seed(0)
    v = 6
    p = torch.softmax(torch.randn(2, N + 1, v, generator=g), -1)
    target_probs = p.clone()  # the hook writes ν into SGLang's buffer in place
    q = torch.softmax(torch.randn(2, N, v, generator=g), -1)
    seen = {}

    def eagle_sample(verify_input, batch, logits_output):
        return verify_hooks.chain_kernel_around(
            lambda **kw: seen.update(kw), target_probs=target_probs, draft_probs=q
        )

    hook = verify_hooks.make_eagle_sample_hook(SETTINGS, learned)
    verify_input = SimpleNamespace(draft_token_num=N + 1, draft_probs=q)
    hook(eagle_sample, verify_input, batch, SimpleNamespace(next_token_logits=torch.zeros(2 * (N + 1), v)))
    nu = seen["target_probs"]
    assert torch.allclose(nu[0, :N], 0.25 * p[0, :N] + 0.75 * q[0])  # the head's w_t
    assert torch.allclose(nu[1, :N], 0.5 * p[1, :N] + 0.5 * q[1])


def test_head_path_adds_the_capture_hooks(tmp_path):
    path = tmp_path / "h.pt"
    torch.jit.save(torch.jit.script(ConcatHead(2, 2)), str(path))
    specs = {
        target: kind for target, _, kind in hook_specs(PluginSettings(enabled=True, head_path=str(path)))
    }
    assert specs[LOAD_MODEL] == "AFTER" and specs[MODEL_FORWARD] == "AROUND"
    assert MODEL_FORWARD not in {t for t, _, _ in hook_specs(PluginSettings(enabled=True))}


def test_hf_model_capture_through_the_load_model_hook(pair):
    """The capture attaches to real (HF) Llama models' final norm via the AFTER hook."""
    target, draft = pair
    learned = LearnedHead(RecordingHead())
    hook = make_load_model_hook(learned)
    hook(None, SimpleNamespace(model=target, is_draft_worker=False))
    hook(None, SimpleNamespace(model=draft, is_draft_worker=True))
    with torch.no_grad():
        out = draft(torch.tensor([[1, 5, 7]]), output_hidden_states=True)
    assert torch.allclose(learned.draft.last, out.hidden_states[-1]) and learned.target.last is None
