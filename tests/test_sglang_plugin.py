"""The dialspec SGLang plugin against SGLang 0.5.23's real code, on CPU (no GPU in CI).

Requires the venv from `make venv` (sglang installed with --no-deps plus light deps). Without it
these tests FAIL with a message; they never skip.

What imports on CPU: `sglang.srt.plugins`, `.hook_registry`, `server_args`, `arg_groups.*`,
`sampling.sampling_params`, `speculative.spec_info` and the Triton kernel module (real). The
speculative workers, `eagle_utils` and `schedule_batch` import `sglang.srt.configs`, which
imports torchvision at module level; PyPI only has CUDA torchvision wheels, which do not load
next to CPU torch. For those imports a stand-in `torchvision` (no attributes are used by the
code under test) is put on the import path for the duration of the import and removed after, so
other tests never see it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verifier.dial import Verification

try:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
except ImportError as exc:  # pragma: no cover - the message is the point
    pytest.fail(
        f"SGLang 0.5.23 is not importable ({exc}); run `make venv` (installs sglang --no-deps "
        "and its light deps) - these tests must not be skipped",
        pytrace=False,
    )

import server.sglang_plugin as plugin
from server.sglang_plugin import args_hook, liveness, params, verify_hooks
from server.sglang_plugin.ensemble import chain_rejection_reference
from tests.sglang_cpu import import_heavy


@pytest.fixture(scope="module")
def sglang_heavy():
    """SGLang's speculative modules, imported with torchvision stood in (tests/sglang_cpu.py)."""
    return import_heavy()


@pytest.fixture(autouse=True)
def fresh_liveness():
    """Each test starts with no hooks expected (register() records what it registers)."""
    liveness.expect([])
    yield
    liveness.expect([])


@pytest.fixture
def clean_registry():
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry._hooks.clear()
    HookRegistry._patched.clear()
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(saved)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(saved_patched)


def test_entry_point_is_declared_and_loadable():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "dialspec" in eps, "pyproject entry point missing: reinstall with `make venv`"
    assert eps["dialspec"].load() is plugin.register


def test_inactive_plugin_registers_nothing(clean_registry, monkeypatch):
    monkeypatch.delenv(params.ENV_ENABLE, raising=False)
    plugin.register()
    assert dict(clean_registry._hooks) == {}


def test_active_plugin_registers_through_hook_registry(clean_registry, monkeypatch):
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    plugin.register()
    kinds = {t: [h[0] for h in hooks] for t, hooks in clean_registry._hooks.items()}
    assert kinds == {
        args_hook.TARGET: [HookType.AROUND],
        verify_hooks.EAGLE_SAMPLE: [HookType.AROUND],
        verify_hooks.CHAIN_KERNEL: [HookType.AROUND],
        verify_hooks.DRAFT: [HookType.AROUND],
        liveness.SCHEDULER_INIT: [HookType.BEFORE],
    }


def test_load_plugins_discovers_and_runs_the_plugin(clean_registry, monkeypatch):
    import sglang.srt.plugins as plugins_mod

    monkeypatch.setenv(params.ENV_ENABLE, "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "dialspec")  # SGLang's own whitelist: only ours
    found = plugins_mod.load_plugins_by_group(plugins_mod.GENERAL_PLUGINS_GROUP)
    assert set(found) == {"dialspec"}
    func, _dist = found["dialspec"]
    func()
    assert args_hook.TARGET in clean_registry._hooks


def _target_exists_in_source(target: str) -> bool:
    """Resolve `module.Class.method` / `module.func` by parsing the real source (no import)."""
    parts = target.split(".")
    root = Path(importlib.util.find_spec("sglang").origin).parent  # sglang/ (not imported deeper)
    for cut in range(len(parts) - 1, 1, -1):
        source = root.joinpath(*parts[1:cut]).with_suffix(".py")
        if source.is_file():
            tree = ast.parse(source.read_text(encoding="utf-8"))
            names = parts[cut:]
            scope = tree.body
            for name in names:
                node = next(
                    (
                        n
                        for n in scope
                        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                        and n.name == name
                    ),
                    None,
                )
                if node is None:
                    return False
                scope = getattr(node, "body", [])
            return True
    return False


def test_every_hook_target_exists_in_sglang_source():
    for target, _hook, _kind in plugin.hook_specs(params.PluginSettings(enabled=True)):
        assert _target_exists_in_source(target), f"{target} not found in SGLang 0.5.23 source"
    assert _target_exists_in_source(plugin.LOAD_MODEL)


@pytest.fixture
def restore_targets(sglang_heavy, monkeypatch):
    """Every hook target (and the `from X import f` copies SGLang holds) restored after the test."""
    eagle_utils = sglang_heavy["sglang.srt.speculative.eagle_utils"]
    common = sglang_heavy["sglang.srt.speculative.eagle_worker_common"]
    rs = sglang_heavy["sglang.kernels.ops.speculative.reject_sampling"]
    for mod, name in [
        (eagle_utils, "eagle_sample"),
        (common, "eagle_sample"),
        (rs, "chain_speculative_sampling_triton"),
        (eagle_utils, "chain_speculative_sampling_triton"),
    ]:
        monkeypatch.setattr(mod, name, getattr(mod, name))
    for target in [t for t, _, _ in plugin.hook_specs(params.PluginSettings(enabled=True))] + [
        liveness.SCHEDULER_INIT,
        plugin.LOAD_MODEL,
        plugin.MODEL_FORWARD,
    ]:
        owner_path, name = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        monkeypatch.setattr(owner, name, raw)
    return sglang_heavy


def test_hooks_apply_to_the_real_functions_and_propagate(restore_targets, clean_registry, monkeypatch):
    """apply_hooks patches every target, including `from X import f` copies in callers, and the
    liveness check then finds every hook live (launcher and scheduler checkpoints pass)."""
    eagle_utils = restore_targets["sglang.srt.speculative.eagle_utils"]
    common = restore_targets["sglang.srt.speculative.eagle_worker_common"]
    rs = restore_targets["sglang.kernels.ops.speculative.reject_sampling"]
    originals = {
        (eagle_utils, "eagle_sample"): eagle_utils.eagle_sample,
        (common, "eagle_sample"): common.eagle_sample,
        (rs, "chain_speculative_sampling_triton"): rs.chain_speculative_sampling_triton,
        (eagle_utils, "chain_speculative_sampling_triton"): eagle_utils.chain_speculative_sampling_triton,
    }
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    plugin.register()
    assert liveness.missing_hooks(liveness._expected) != []  # registered, not yet applied
    clean_registry.apply_hooks()
    assert clean_registry._patched == set(clean_registry._hooks)
    for (mod, name), fn in originals.items():
        assert getattr(mod, name) is not fn and getattr(mod, name).__wrapped__ is fn, f"{mod.__name__}.{name}"
    assert liveness.missing_hooks(liveness._expected) == []
    liveness.verify_live("launcher")
    liveness.scheduler_init_check(object())


def _sglang_load_plugins(monkeypatch):
    """SGLang's own `load_plugins()` (discovery, register(), apply_hooks()), run afresh."""
    import sglang.srt.plugins as plugins_mod

    monkeypatch.setattr(plugins_mod, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "dialspec")
    plugins_mod.load_plugins()


def _scheduler_cls(sglang_heavy):
    return sglang_heavy["sglang.srt.managers.scheduler"].Scheduler


def test_a_hook_that_fails_to_apply_stops_the_scheduler(restore_targets, clean_registry, monkeypatch, caplog):
    """The silent no-op: SGLang logs the failed patch and carries on; our checkpoint does not."""
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    monkeypatch.setattr(verify_hooks, "EAGLE_SAMPLE", "sglang.srt.speculative.eagle_utils.no_such_function")
    with caplog.at_level("ERROR"):
        _sglang_load_plugins(monkeypatch)  # returns normally: SGLang swallowed the failure
    assert "Failed to apply hooks to sglang.srt.speculative.eagle_utils.no_such_function" in caplog.text
    scheduler = _scheduler_cls(restore_targets)
    with pytest.raises(liveness.HooksNotLive) as info:
        scheduler.__init__(scheduler.__new__(scheduler), None, None)  # the real, patched __init__
    message = str(info.value)
    assert message.startswith("dialspec SGLang plugin (scheduler): hooks not live") and "\n" not in message
    assert "eagle_utils.no_such_function (cannot resolve" in message


@pytest.mark.parametrize("damage", ["unpatched", "stale_copy"])
def test_launcher_checkpoint_refuses_hooks_that_are_not_live(
    restore_targets, clean_registry, stock_handler, tiny_pair, monkeypatch, damage
):
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    _sglang_load_plugins(monkeypatch)
    _hooked(stock_handler)(_args(tiny_pair))  # all live: the real resolver passes
    eagle_utils = restore_targets["sglang.srt.speculative.eagle_utils"]
    common = restore_targets["sglang.srt.speculative.eagle_worker_common"]
    original = eagle_utils.eagle_sample.__wrapped__
    if damage == "unpatched":
        monkeypatch.setattr(eagle_utils, "eagle_sample", original)
        monkeypatch.setattr(common, "eagle_sample", original)
        expected = "eagle_utils.eagle_sample (not patched)"
    else:  # a `from eagle_utils import eagle_sample` copy the propagation missed
        monkeypatch.setattr(common, "eagle_sample", original)
        expected = "unpatched copies in sglang.srt.speculative.eagle_worker_common.eagle_sample"
    with pytest.raises(liveness.HooksNotLive, match="launcher") as info:
        _hooked(stock_handler)(_args(tiny_pair))
    assert expected in str(info.value)


def test_setup_errors_stop_startup_instead_of_being_swallowed(
    clean_registry, stock_handler, tiny_pair, monkeypatch
):
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    monkeypatch.setenv(params.ENV_DEFAULT_W, "2")
    plugin.register()  # would be swallowed by load_plugins if it raised
    assert set(clean_registry._hooks) == {args_hook.TARGET, liveness.SCHEDULER_INIT}
    ((_, hook, _),) = clean_registry._hooks[args_hook.TARGET]
    with pytest.raises(liveness.HooksNotLive, match=r"setup failed: DIALSPEC_DEFAULT_W='2'"):
        hook(stock_handler, _args(tiny_pair))
    with pytest.raises(liveness.HooksNotLive, match="setup failed"):
        liveness.scheduler_init_check(object())

    clean_registry._hooks.clear()
    monkeypatch.setenv(params.ENV_HEAD_PATH, "/no/such/head.pt")
    monkeypatch.setenv(params.ENV_DEFAULT_W, "0.5")
    plugin.register()
    with pytest.raises(liveness.HooksNotLive, match="setup failed: .*no/such/head.pt"):
        liveness.verify_live("launcher")

    clean_registry._hooks.clear()
    monkeypatch.delenv(params.ENV_ENABLE)
    monkeypatch.setenv(params.ENV_DEFAULT_W, "2")
    plugin.register()  # plugin off: a bad w is not its business
    assert dict(clean_registry._hooks) == {}


# ---------------------------------------------------------------------------- argument hook


@pytest.fixture
def stock_handler(sglang_heavy):
    """The real `_handle_eagle_family`, needing the heavy imports for HF config loading."""
    sh = importlib.import_module("sglang.srt.arg_groups.speculative_hook")
    return sh._handle_eagle_family


def _args(tiny_pair, **overrides):
    target, draft = tiny_pair
    kw = dict(
        model_path=str(target),
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        speculative_use_rejection_sampling=True,
        device="cpu",
    )
    kw.update(overrides)
    return ServerArgs(**kw)


def _hooked(stock):
    return lambda server_args: args_hook.handle_eagle_family_around(stock, server_args)


def test_stock_sglang_refuses_standalone_rejection_sampling(stock_handler, tiny_pair):
    with pytest.raises(NotImplementedError, match="STANDALONE"):
        stock_handler(_args(tiny_pair))


def test_arg_hook_inactive_is_stock(stock_handler, tiny_pair, monkeypatch):
    monkeypatch.delenv(params.ENV_ENABLE, raising=False)
    with pytest.raises(NotImplementedError):
        _hooked(stock_handler)(_args(tiny_pair))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"speculative_use_rejection_sampling": False},  # the plugin turns it on
        {"speculative_num_steps": None, "speculative_eagle_topk": None, "speculative_num_draft_tokens": None},
        {"speculative_num_steps": 5, "speculative_num_draft_tokens": 3},  # SGLang fixes it to N+1
    ],
)
def test_arg_hook_accepts_standalone_chain_configs(stock_handler, tiny_pair, monkeypatch, overrides):
    from sglang.srt.arg_groups.overrides import resolution_result

    monkeypatch.setenv(params.ENV_ENABLE, "1")
    args = _args(tiny_pair, **overrides)
    _hooked(stock_handler)(args)
    assert resolution_result(args, "speculative_use_rejection_sampling") is True
    assert resolution_result(args, "speculative_eagle_topk") == 1
    steps = resolution_result(args, "speculative_num_steps")
    assert resolution_result(args, "speculative_num_draft_tokens") == steps + 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}, "topk must be 1"),
        ({"speculative_use_block_verification": True}, "block-verification"),
        ({"speculative_accept_threshold_single": 0.5}, "accept-threshold"),
        ({"speculative_accept_threshold_acc": 0.7}, "accept-threshold"),
    ],
)
def test_arg_hook_refuses_incompatible_configs(stock_handler, tiny_pair, monkeypatch, overrides, message):
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    with pytest.raises(args_hook.DialspecConfigError, match=message):
        _hooked(stock_handler)(_args(tiny_pair, **overrides))


def test_arg_hook_leaves_other_algorithms_alone(tiny_pair, monkeypatch):
    monkeypatch.setenv(params.ENV_ENABLE, "1")
    seen = []
    args = _args(tiny_pair, speculative_algorithm="EAGLE", speculative_eagle_topk=4)
    args_hook.handle_eagle_family_around(seen.append, args)
    assert seen == [args] and getattr(args, "_resolved_overrides", None) in (None, [])


# ---------------------------------------------------------------------------- per-row weights


def _req(**kwargs):
    sp = SamplingParams(**kwargs)
    sp.normalize(None)
    return SimpleNamespace(sampling_params=sp)


def test_row_params_from_real_sampling_params():
    reqs = [
        _req(temperature=1.0, custom_params={"dialspec_w": 0.25}),
        _req(temperature=0.7),  # no dial: server default
        _req(temperature=1.0, custom_params={"dialspec_w": 0.5, "dialspec_mode": "autoregressive"}),
        _req(temperature=1.0, custom_params={"dialspec_w": "bogus"}),
        _req(temperature=1.0, custom_params={"dialspec_w": 0.9, "dialspec_dial": 0.7}),
        _req(temperature=1.0, custom_params=params.custom_params_for(Verification(weight=0.125))),
    ]
    got = params.batch_row_params(reqs, default_w=0.8)
    assert [r.weight for r in got] == [0.25, 0.8, 1.0, 0.8, 0.9, 0.125]
    assert [r.learned for r in got] == [False, False, False, False, True, False]
    assert got[4].dial == 0.7  # the head's input travels apart from the static w


def test_greedy_request_is_top_k_one_after_sglang_normalisation():
    sp = _req(temperature=0.0).sampling_params
    assert sp.top_k == 1 and sp.temperature == 1.0  # what verify_hooks keys greedy rows on


# ---------------------------------------------------------------------------- verify data flow


def test_eagle_sample_hook_feeds_nu_to_the_kernel(monkeypatch):
    """SGLang's real eagle_sample (tests/sglang_eagle_cpu.py) with the hooks: the kernel receives ν
    for sampled rows, one-hot argmax ν for a greedy row, p at the bonus slot."""
    from tests import sglang_eagle_cpu as sgl_eagle

    monkeypatch.setattr(verify_hooks, "_is_standalone", lambda: True)
    seen = {}

    def kernel(**kw):
        seen.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    sgl_eagle.stand_in_platform(monkeypatch, lambda **kw: verify_hooks.chain_kernel_around(kernel, **kw))
    g = torch.Generator().manual_seed(0)
    bs, n, v = 3, 2, 5
    logits = torch.randn(bs * (n + 1), v, generator=g)
    q = torch.softmax(torch.randn(bs, n, v, generator=g), -1)
    reqs = [
        sgl_eagle.Req("a", v, temperature=1.0, custom_params={"dialspec_w": 0.3}),
        sgl_eagle.Req("b", v, temperature=0.0, custom_params={"dialspec_w": 0.5}),  # greedy
        sgl_eagle.Req("c", v, temperature=1.0),  # server default
    ]
    batch = sgl_eagle.Batch(reqs, v)
    cand = torch.zeros(bs, n + 1, dtype=torch.long)
    hook = verify_hooks.make_eagle_sample_hook(params.PluginSettings(enabled=True, default_w=0.6))
    out = SimpleNamespace(next_token_logits=logits.clone())
    hook(sgl_eagle.modules().eagle_utils.eagle_sample, sgl_eagle.verify_input(cand, q), batch, out)
    assert verify_hooks._step.ctx is None
    p = logits.view(bs, n + 1, v).softmax(-1)
    tp = seen["target_probs"]
    assert torch.allclose(tp[0, :n], 0.3 * p[0, :n] + 0.7 * q[0], atol=1e-6)
    assert torch.allclose(tp[2, :n], 0.6 * p[2, :n] + 0.4 * q[2], atol=1e-6)
    assert torch.allclose(tp[[0, 2], n], p[[0, 2], n])  # bonus slot is p
    nu_greedy = 0.5 * p[1, :n] + 0.5 * q[1]
    assert torch.equal(tp[1, :n].argmax(-1), nu_greedy.argmax(-1))  # greedy row: one-hot argmax ν
    assert float(tp[1, :n].max(-1).values.min()) == 1.0
    assert int(tp[1, n].argmax()) == int(p[1, n].argmax())  # greedy bonus: argmax p


def test_kernel_hook_is_a_passthrough_outside_a_verify_step():
    calls = []
    verify_hooks.chain_kernel_around(lambda **kw: calls.append(kw), target_probs="p", draft_probs="q")
    assert calls == [{"target_probs": "p", "draft_probs": "q"}]


def test_reference_kernel_agrees_with_sglang_triton_signature(sglang_heavy):
    """Our reference mirrors the kernel's interface names; check they still exist in 0.5.23."""
    import inspect

    rs = sglang_heavy["sglang.kernels.ops.speculative.reject_sampling"]
    sig = inspect.signature(rs.chain_speculative_sampling_triton)
    names = {"candidates", "uniform_samples", "uniform_samples_for_final_sampling"}
    names |= {"target_probs", "draft_probs"}
    assert names <= set(sig.parameters)
    eu = sglang_heavy["sglang.srt.speculative.eagle_utils"]
    first = list(inspect.signature(eu.eagle_sample).parameters)[:3]
    assert first == ["verify_input", "batch", "logits_output"]
    assert callable(chain_rejection_reference)


@pytest.mark.parametrize(
    "flags, still_on",
    [
        ({}, "decode, prefill"),
        ({"disable_decode_cuda_graph": True}, "prefill"),  # the breakable prefill graph stays on
        ({"disable_prefill_cuda_graph": True}, "decode"),
        ({"disable_cuda_graph": True}, None),
        ({"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"}, None),
        ({"disable_cuda_graph": True, "cuda_graph_backend_decode": "full"}, "decode"),  # SGLang's precedence
    ],
)
@pytest.mark.parametrize("resolved", [False, True], ids=["raw-flags", "resolved-config"])
def test_learned_head_needs_every_cuda_graph_off(
    stock_handler, tiny_pair, monkeypatch, tmp_path, flags, still_on, resolved
):
    """Forward hooks do not run on graph replay: decode (draft, draft-extend, verify) and
    prefill (breakable) graphs must all be off. Checked on raw flags and on the config SGLang's
    own `parse_cuda_graph_config` resolves (which runs before the speculative handler)."""
    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    from sglang.srt.arg_groups.overrides import resolving_view

    monkeypatch.setenv(params.ENV_ENABLE, "1")
    monkeypatch.setenv(params.ENV_HEAD_PATH, str(tmp_path))
    args = _args(tiny_pair, **flags)
    if resolved:
        import sglang.srt.model_executor.cuda_graph_config as graph_config

        # SGLang's default prefill backend is "breakable" on CUDA and "disabled" elsewhere.
        monkeypatch.setattr(graph_config, "default_prefill_backend", lambda: "breakable")
        parse_cuda_graph_config(args)
        assert hasattr(resolving_view(args).cuda_graph_config, "prefill")  # the resolved object
    if still_on is None:
        _hooked(stock_handler)(args)
    else:
        with pytest.raises(
            args_hook.DialspecConfigError, match=f"--disable-cuda-graph.*still on: {still_on}$"
        ):
            _hooked(stock_handler)(args)
