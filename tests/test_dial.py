"""The dial (`verifier.dial`) as a unit: quality -> verification, tiers, auto, names, wire format."""

from __future__ import annotations

import subprocess
import sys

import pytest

from verifier.dial import (
    DialConfig,
    DialError,
    PolicyKind,
    Verification,
    from_custom_params,
    model_names,
    resolve,
    tier_from_model_name,
)


def test_quality_is_w_and_tiers_map_through_the_config():
    for q in (0.0, 0.3, 1.0):
        d = resolve(q)
        v = d.verification
        assert v.weight == pytest.approx(q) and d.label == "custom" and v.policy == PolicyKind.ENSEMBLE
        assert not v.learned and d.policy_name == "ensemble"
    assert resolve("lite").verification.weight == 0.25 and resolve("exact").verification.weight == 1.0
    assert resolve().label == "exact" and resolve().verification.weight == 1.0  # lossless by default
    assert resolve(model_tier="pro").verification.weight == 0.75
    assert resolve(0.1, model_tier="pro").verification.weight == pytest.approx(0.1)  # body beats name


def test_configurable_mapping_and_baselines():
    cfg = DialConfig(gamma=2.0, tiers={"fast": 0.5}, default_quality="fast")
    assert resolve("fast", config=cfg).verification.weight == pytest.approx(0.25)
    assert resolve(0.3, policy=PolicyKind.LOSSY).verification.lenience == pytest.approx(0.3)
    assert resolve(0.0, policy=PolicyKind.LOSSY).verification.lenience == pytest.approx(0.05)  # l > 0
    assert resolve(0.25, policy=PolicyKind.CASCADE).verification.alpha == pytest.approx(0.75)
    typical = resolve(0.5, policy=PolicyKind.TYPICAL)
    assert typical.verification.policy == PolicyKind.TYPICAL and typical.policy_name == "typical"
    ar = resolve(0.5, mode="autoregressive")
    assert ar.verification.mode == "autoregressive" and ar.label == "autoregressive" and ar.quality is None
    assert resolve(0.5, num_draft=3).verification.num_draft == 3


@pytest.mark.parametrize(
    "quality,param",
    [(1.5, "quality"), (-0.1, "quality"), (True, "quality"), (float("nan"), "quality"), ("turbo", "quality")],
)
def test_bad_quality_names_the_field(quality, param):
    for mode in ("speculative", "autoregressive"):  # ignored in autoregressive mode, still checked
        with pytest.raises(DialError) as e:
            resolve(quality, mode=mode)
        assert e.value.param == param and e.value.code == "invalid_quality"
    assert resolve("exact", mode="autoregressive").label == "autoregressive"


def test_unknown_tier_from_the_model_name_blames_the_model_field():
    with pytest.raises(DialError) as e:
        resolve(model_tier="turbo")
    assert e.value.param == "model"


def test_auto_needs_a_head_and_uses_its_dial_unless_the_server_overrides():
    with pytest.raises(DialError) as e:
        resolve("auto")
    assert e.value.code == "head_unavailable"
    d = resolve("auto", head_dial=0.4)
    assert d.verification.learned and d.verification.dial == 0.4 and d.label == "auto" and d.quality == 0.4
    assert resolve("auto", head_dial=0.4, config=DialConfig(auto_dial=0.7)).verification.dial == 0.7
    with pytest.raises(DialError, match="ensemble"):
        resolve("auto", head_dial=0.4, policy=PolicyKind.LOSSY)


def test_policy_names_parse_once_and_round_trip():
    for kind in PolicyKind:
        assert PolicyKind.parse(kind.wire) is kind
    with pytest.raises(DialError) as e:
        PolicyKind.parse("greedy")
    assert e.value.param == "verifier"


def test_verification_validate_refuses_out_of_range_values():
    Verification(weight=0.5, dial=0.2, num_draft=3).validate(max_num_draft=8)
    for bad, field in [
        (Verification(weight=1.5), "weight"),
        (Verification(dial=-0.1), "dial"),
        (Verification(num_draft=0), "num_draft"),
        (Verification(num_draft=True), "num_draft"),
        (Verification(lenience=0.0), "lenience"),
        (Verification(policy=PolicyKind.LOSSY, dial=0.5), "verifier"),
    ]:
        with pytest.raises(DialError) as e:
            bad.validate()
        assert e.value.param == field
    with pytest.raises(DialError):
        Verification(num_draft=9).validate(max_num_draft=8)


def test_config_refuses_bad_tiers_and_defaults():
    for kwargs in (
        {"tiers": {"bad": 2.0}},
        {"tiers": {"a:b": 0.5}},
        {"tiers": {"auto": 0.5}},
        {"default_quality": "nope"},
        {"gamma": 0.0},
        {"auto_dial": 1.2},
    ):
        with pytest.raises(DialError):
            DialConfig(**kwargs)


def test_model_names_round_trip():
    cfg = DialConfig()
    for name in model_names("m", cfg):
        tier = tier_from_model_name(name, "m", cfg)
        assert tier is None or tier in cfg.tiers
    with pytest.raises(LookupError):
        tier_from_model_name("m:nope", "m", cfg)
    with pytest.raises(LookupError):
        tier_from_model_name("m:auto", "m", cfg)  # no head, no auto
    assert model_names("m", cfg, has_head=True)[-1] == "m:auto"
    assert tier_from_model_name("m:auto", "m", cfg, has_head=True) == "auto"


def test_sglang_wire_format_round_trips():
    for v in (Verification(weight=0.25), Verification(weight=0.5, dial=0.3)):
        back = from_custom_params(v.to_custom_params())
        assert (back.weight, back.dial, back.mode) == (v.weight, v.dial, v.mode)
    assert from_custom_params({}, default_w=0.8).weight == 0.8
    assert from_custom_params({"dialspec_mode": "autoregressive", "dialspec_w": 0.1}).weight == 1.0
    with pytest.raises(DialError):
        from_custom_params({"dialspec_w": "lots"})


def test_the_dial_module_does_not_import_torch():
    code = "import sys, verifier.dial; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
