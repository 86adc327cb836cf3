"""`Float8Training` and `Policy.fp8`: plain data, validated, through the config edge."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mixprec
from mixprec.policy import FP8_PRESET_NAMES, FP8_RECIPES, Float8Training, Policy, preset

BF16 = torch.bfloat16


def test_recipes_are_torchaos_names() -> None:
    assert tuple(FP8_RECIPES) == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    for recipe in FP8_RECIPES:
        assert Float8Training(recipe=recipe).recipe == recipe


def test_an_unknown_recipe_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="tensorwise, rowwise, rowwise_with_gw_hp") as info:
        Float8Training(recipe="delayed")
    assert "'delayed'" in str(info.value)


def test_defaults() -> None:
    s = Float8Training()
    assert (s.recipe, s.emulate, s.min_divisor, s.skip_first_last, s.exclude) == (
        "tensorwise",
        None,
        16,
        True,
        (),
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"emulate": "yes"}, TypeError, "emulate must be"),
        ({"min_divisor": 0}, ValueError, "min_divisor must be an int >= 1"),
        ({"min_divisor": True}, ValueError, "min_divisor must be an int >= 1"),
        ({"min_divisor": 8}, ValueError, "divisible by 16; fix: min_divisor=16"),
        ({"skip_first_last": 1}, TypeError, "skip_first_last must be"),
        ({"exclude": "head"}, TypeError, r"wrap it: exclude=\('head',\)"),
        ({"exclude": ("head", 3)}, TypeError, "exclude entries"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Float8Training(**kwargs)  # type: ignore[arg-type]


def test_a_divisor_other_than_16_needs_emulation() -> None:
    assert Float8Training(min_divisor=8, emulate=True).min_divisor == 8
    assert Float8Training(min_divisor=32).min_divisor == 32
    assert Float8Training(exclude=["a.*"]).exclude == ("a.*",)  # type: ignore[arg-type]


def test_exclude_patterns_match_qualified_names() -> None:
    s = Float8Training(exclude=("blocks.0.*", "*.head"))
    assert s.excludes("blocks.0.attn") == "blocks.0.*"
    assert s.excludes("model.head") == "*.head"
    assert s.excludes("blocks.1.attn") is None


def test_fp8_needs_bf16_compute_and_says_the_fix() -> None:
    for compute in (None, torch.float16):
        with pytest.raises(ValueError, match=r"needs bf16 compute.*compute_dtype=torch.bfloat16"):
            Policy(
                compute_dtype=compute,
                allow_unscaled=True,
                fp8=Float8Training(),
            )
    with pytest.raises(TypeError, match=r"fp8 must be a mixprec\.Float8Training"):
        Policy(compute_dtype=BF16, fp8={"recipe": "rowwise"})  # type: ignore[arg-type]
    # fp32 storage with bf16 compute works (the preset's bf16 storage is the tested one)
    assert Policy(compute_dtype=BF16, fp8=Float8Training()).fp8 == Float8Training()


def test_presets_are_bf16_master_with_fp8_linears() -> None:
    bf16_master = preset("bf16_master")
    for name, recipe in zip(FP8_PRESET_NAMES, FP8_RECIPES, strict=True):
        p = preset(name)
        assert p.fp8 == Float8Training(recipe=recipe)
        assert p.replace(name="bf16_master", fp8=None) == bf16_master
        assert p.risks() == ()
        assert not p.scales_loss
        assert f"fp8 linears {recipe}" in p.describe()
    assert set(FP8_PRESET_NAMES) <= set(mixprec.policy.PRESET_NAMES)


def test_converting_the_first_and_last_layers_is_a_risk() -> None:
    p = preset("fp8_tensorwise").replace(fp8=Float8Training(skip_first_last=False))
    (risk,) = p.risks()
    assert "skip_first_last=False" in risk and "output head" in risk


def test_dict_round_trip() -> None:
    p = preset("fp8_rowwise").replace(
        fp8=Float8Training(recipe="rowwise", emulate=True, min_divisor=8, exclude=("head",))
    )
    d = json.loads(json.dumps(p.to_dict()))
    assert d["fp8"] == {
        "recipe": "rowwise",
        "emulate": True,
        "min_divisor": 8,
        "skip_first_last": True,
        "exclude": ["head"],
    }
    assert Policy.from_dict(d) == p
    assert preset("bf16_master").to_dict()["fp8"] is None


def test_from_dict_the_yaml_spellings() -> None:
    # precision: {preset: fp8_tensorwise, fp8: {recipe: rowwise}}: given fields replace the
    # preset's own fp8 fields, the others stay
    p = Policy.from_dict({"preset": "fp8_tensorwise", "fp8": {"recipe": "rowwise"}})
    assert p.fp8 == Float8Training(recipe="rowwise") and p.name == "custom"
    p = Policy.from_dict({"preset": "fp8_rowwise", "fp8": {"exclude": "head"}})
    assert p.fp8 == Float8Training(recipe="rowwise", exclude=("head",))
    # a recipe name, or fp8 added to a 16-bit preset
    assert Policy.from_dict({"preset": "bf16_master", "fp8": "rowwise"}).fp8 == Float8Training(
        recipe="rowwise"
    )
    assert Policy.from_dict({"preset": "fp8_rowwise", "fp8": None}).fp8 is None
    assert Policy.from_dict({"preset": "fp8_rowwise"}).name == "fp8_rowwise"
    assert (
        Policy.from_dict({"preset": "fp8_tensorwise", "fp8": {"emulate": "auto"}}).fp8
        == Float8Training()
    )


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"recipe": "delayed"}, "valid recipes: tensorwise"),
        ({"scaling": "delayed"}, r"unknown fp8 keys \['scaling'\]"),
        ({"emulate": "sometimes"}, "emulate must be true, false or auto"),
        ({"skip_first_last": "no"}, "fp8: skip_first_last must be True or False"),
        (7, "fp8 must be null, a recipe name"),
    ],
)
def test_from_dict_refuses_bad_fp8_values(raw: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy.from_dict({"preset": "bf16_master", "fp8": raw})


def test_fp8_on_an_fp16_preset_is_refused_from_config() -> None:
    with pytest.raises(ValueError, match="needs bf16 compute"):
        Policy.from_dict({"preset": "amp_fp16", "fp8": "tensorwise"})


def test_the_presets_are_data_without_torchao() -> None:
    """Listing and building the fp8 presets imports neither torchao nor the engine."""
    code = (
        "import sys; from mixprec.policy import preset; "
        "[preset(n).to_dict() for n in ('fp8_tensorwise', 'fp8_rowwise', 'fp8_rowwise_gw_hp')]; "
        "print(sorted(m for m in sys.modules if m.startswith(('torchao', 'mixprec.engine'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
