from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.device import DeviceCaps
from mixprec.errors import PrecisionWarning
from mixprec.policy import (
    ALIASES,
    PRESET_NAMES,
    LossScaling,
    Policy,
    preset,
    resolve_auto,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The preset table of ARCHITECTURE.md, as data: compute, params, master, moments, scaled.
EXPECTED = {
    "fp32": (None, FP32, "none", "fp32", False),
    "amp_bf16": (BF16, FP32, "none", "fp32", False),
    "amp_fp16": (FP16, FP32, "none", "fp32", True),
    "fp16_unscaled": (FP16, FP32, "none", "fp32", False),
    "bf16_master": (BF16, BF16, "exact", "fp32", False),
    "bf16_lean": (BF16, BF16, "remainder8", "int8", False),
    "bf16_lean4": (BF16, BF16, "remainder8", "int4", False),
    "bf16_kahan": (BF16, BF16, "kahan", "bf16", False),
    "bf16_sr": (BF16, BF16, "stochastic", "bf16", False),
    "bf16_pure": (BF16, BF16, "none", "bf16", False),
    "fp8_tensorwise": (BF16, BF16, "exact", "fp32", False),
    "fp8_rowwise": (BF16, BF16, "exact", "fp32", False),
    "fp8_rowwise_gw_hp": (BF16, BF16, "exact", "fp32", False),
}
# The fp8 presets' torchao recipes; every other preset has no fp8.
EXPECTED_FP8 = {
    "fp8_tensorwise": "tensorwise",
    "fp8_rowwise": "rowwise",
    "fp8_rowwise_gw_hp": "rowwise_with_gw_hp",
}


def get(name: str) -> Policy:
    """The preset: built without any warning; only the pure-bf16 one lists a risk."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = preset(name)
    assert not caught, (name, [str(w.message) for w in caught])
    assert bool(p.risks()) == (p.name == "bf16_pure"), (name, p.risks())
    return p


def test_preset_table() -> None:
    assert set(EXPECTED) == set(PRESET_NAMES)
    for name, (compute, params, master, moments, scaled) in EXPECTED.items():
        p = get(name)
        assert p.name == name
        assert (None if p.fp8 is None else p.fp8.recipe) == EXPECTED_FP8.get(name)
        assert (p.compute_dtype, p.param_dtype, p.master, p.moments, p.scales_loss) == (
            compute,
            params,
            master,
            moments,
            scaled,
        )
        assert p.reduce_dtype == FP32, "gradient reduction defaults to fp32"
        assert p.release_gradients == (name == "bf16_lean4")  # the one preset that releases


@pytest.mark.parametrize(("alias", "target"), sorted(ALIASES.items()))
def test_every_alias_maps_to_its_preset(alias: str, target: str) -> None:
    assert get(alias) == get(target)
    assert get(alias.upper()) == get(target)


@pytest.mark.parametrize(
    ("alias", "target"),
    [
        ("bf16-mixed", "amp_bf16"),
        ("16-mixed", "amp_fp16"),
        ("bf16-true", "bf16_pure"),
        ("amp_bf16", "amp_bf16"),
        ("amp_fp16", "amp_fp16"),
        ("fp16", "amp_fp16"),
        ("bf16", "amp_bf16"),
        ("32", "fp32"),
    ],
)
def test_issue_spellings(alias: str, target: str) -> None:
    assert get(alias).name == target


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown precision policy 'bf17'.*bf16_master.*auto"):
        preset("bf17")


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("bf16_mastr", "bf16_master"), ("BF16-Mastr", "bf16_master"), ("bf16-mixd", "bf16-mixed")],
)
def test_a_typo_of_a_name_says_what_was_meant(typo: str, meant: str) -> None:
    """Found in issue 30: a typo printed the whole list with no suggestion."""
    with pytest.raises(ValueError, match=rf"'{typo}' \(did you mean '{meant}'\?\); valid"):
        preset(typo)
    with pytest.raises(ValueError) as info:
        preset("zzz")  # nothing close: no suggestion
    assert "did you mean" not in str(info.value)


def test_pure_bf16_warns_where_it_is_used_not_when_built() -> None:
    pure = preset("bf16_pure")  # plain data: no warning (pytest turns one into an error)
    assert re.search(r"bf16 with no master.*master='exact'", pure.risks()[0])
    prec = mixprec.Precision(pure)
    with pytest.warns(PrecisionWarning, match=r"bf16 with no master.*master='exact'"):
        prec.prepare(nn.Linear(2, 2))


def test_policy_is_frozen_and_keyword_only() -> None:
    p = preset("amp_bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = FP16  # type: ignore[misc]
    with pytest.raises(TypeError):
        Policy("x")  # type: ignore[misc]


# Each invalid combination and a fragment of the fix its message must name.
INVALID = [
    (dict(compute_dtype=FP16), ValueError, "loss_scaling=LossScaling"),
    (dict(master="fp32"), ValueError, "fp32 params are already the master"),
    (dict(master="exact"), ValueError, "param_dtype=torch.bfloat16"),
    (dict(param_dtype=FP16, master="exact"), ValueError, "needs bf16 params"),
    (dict(param_dtype=FP16, master="remainder8"), ValueError, "needs bf16 params"),
    (dict(param_dtype=FP16, master="stochastic"), ValueError, "needs bf16 params"),
    (
        dict(param_dtype=FP16, master="fp32", compute_dtype=FP16, loss_scaling=LossScaling()),
        ValueError,
        "amp_fp16",
    ),
    (dict(master="bogus"), ValueError, "valid: none, fp32, exact"),
    (dict(moments="fp8"), ValueError, "valid: fp32, bf16, int8"),
    (dict(compute_dtype=torch.float8_e4m3fn), ValueError, "valid: fp32, bf16, fp16, None"),
    (dict(param_dtype=torch.int8), ValueError, "valid: fp32, bf16, fp16"),
    (dict(compute_dtype="bf16"), TypeError, "parse_dtype"),
    (dict(loss_scaling=2.0), TypeError, "LossScaling"),
    (dict(fp32_modules=(3,)), TypeError, "name patterns"),
]


@pytest.mark.parametrize(("kwargs", "exc", "fix"), INVALID)
def test_invalid_combinations_name_the_fix(
    kwargs: dict[str, object], exc: type[Exception], fix: str
) -> None:
    with pytest.raises(exc, match=fix.replace("(", r"\(").replace(".", r"\.")):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_fp16_unscaled_needs_explicit_allowance() -> None:
    p = Policy(compute_dtype=FP16, allow_unscaled=True)
    assert not p.scales_loss


def test_fp32_compute_means_no_autocast() -> None:
    assert Policy(compute_dtype=FP32).compute_dtype is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=0.0),
        dict(init_scale=float("inf")),
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(growth_interval=0),
    ],
)
def test_loss_scaling_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        LossScaling(**kwargs)  # type: ignore[arg-type]


def test_dict_round_trip_for_every_preset() -> None:
    for name in PRESET_NAMES:
        p = get(name)
        d = json.loads(json.dumps(p.to_dict()))
        back = Policy.from_dict(d)
        assert back == p


def test_from_dict_preset_with_overrides() -> None:
    p = Policy.from_dict({"preset": "bf16_master", "moments": "int8", "loss_scaling": 1024})
    assert (p.master, p.moments, p.param_dtype) == ("exact", "int8", BF16)
    assert p.loss_scaling == LossScaling.static(1024.0)
    assert not p.loss_scaling.dynamic
    assert Policy.from_dict({"preset": "bf16-mixed"}).name == "amp_bf16"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"compute": "bf16"}, "unknown policy keys \\['compute'\\]"),
        ({"param_dtype": "bf17"}, "unknown dtype 'bf17'"),
        ({"loss_scaling": {"scale": 2}}, "unknown loss_scaling keys"),
        ({"loss_scaling": "sometimes"}, "loss_scaling must be"),
        ({"fp32_modules": "LayerNorm"}, "fp32_modules must be a list"),
        ({"allow_unscaled": "yes"}, "true or false"),
        ({"preset": "nope"}, "unknown precision policy"),
    ],
)
def test_from_dict_errors(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Policy.from_dict(data)


def test_replace_revalidates() -> None:
    with pytest.raises(ValueError, match="needs bf16 params"):
        preset("bf16_master").replace(param_dtype=FP16)
    assert preset("bf16_master").replace(moments="int8").name == "custom"
    # a replace that changes nothing keeps the name (refusals then name the preset)
    assert preset("bf16_lean4").replace(release_gradients=True).name == "bf16_lean4"
    assert preset("bf16_lean4").replace(release_gradients=False).name == "custom"


def _caps(**kw: object) -> DeviceCaps:
    base: dict[str, object] = dict(
        device_type="cuda",
        name="test gpu",
        bf16_supported=True,
        fp16_supported=True,
        bf16_fast=False,
        fp16_fast=False,
        bf16_reason="bf16 why",
        fp16_reason="fp16 why",
    )
    base.update(kw)
    return DeviceCaps(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        (_caps(bf16_fast=True, fp16_fast=True), "amp_bf16"),
        (_caps(fp16_fast=True), "amp_fp16"),
        (_caps(), "fp32"),
        (_caps(device_type="cpu", fp16_fast=True), "fp32"),
        (_caps(device_type="cpu", bf16_fast=True), "amp_bf16"),
    ],
)
def test_auto_decides_by_device_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caps: DeviceCaps, expected: str
) -> None:
    # `mixprec.policy` is the function; patch the module through sys.modules.
    monkeypatch.setattr(
        importlib.import_module("mixprec.policy.presets"), "device_caps", lambda device=None: caps
    )
    p = resolve_auto()
    assert p.name == expected
    assert "test gpu" in p.note and "why" in p.note
    assert preset("auto") == p


def test_auto_on_this_machine_is_explained() -> None:
    p = mixprec.preset("auto", device="cpu")
    assert p.name in ("amp_bf16", "fp32")
    assert p.note.startswith(f"auto chose {p.name}")


def test_policy_module_is_plain_data_and_does_not_load_the_optimizer() -> None:
    # Checking a master name must not load kernels or the native builder.
    code = (
        "import sys; from mixprec.policy import preset; preset('bf16_lean'); "
        "bad = sorted(m for m in sys.modules if m.startswith(('mixprec.optim', 'mixprec.eng'))); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout


@pytest.mark.parametrize("field", ["reduce_dtype", "output_dtype"])
def test_distributed_fields_are_plain_data_a_precision_accepts(field: str) -> None:
    """They are applied by mixprec.distributed's wrappers and checked by prepare
    (tests/engine/test_plan.py, tests/distributed)."""
    pol = preset("amp_bf16").replace(**{field: torch.bfloat16})
    assert getattr(Policy.from_dict(pol.to_dict()), field) == torch.bfloat16
    assert getattr(mixprec.Precision(pol).plan, field) == torch.bfloat16


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Policy(fp32_modules="LayerNorm"), r"wrap it: fp32_modules=\('LayerNorm',\)"),
        (lambda: Policy(compute_dtype=torch.float16, allow_unscaled="no"), "allow_unscaled"),
        (lambda: LossScaling(dynamic="false"), "dynamic must be True or False"),
        (lambda: LossScaling(init_scale=True), "init_scale must be a number"),
        (lambda: Policy.from_dict({"loss_scaling": {"dynamic": "false"}}), "dynamic must be"),
    ],
)
def test_fields_of_the_wrong_type_are_refused_not_coerced(make: object, words: str) -> None:
    """Found by review: a string fp32_modules was split into characters (no islands at
    all), and any truthy value passed for a boolean."""
    with pytest.raises(TypeError, match=words):
        make()  # type: ignore[operator]


def test_the_risk_names_a_master_the_policy_accepts() -> None:
    """Found by review: fp16 params with no master were told to use master='exact',
    which Policy refuses for fp16."""
    for dtype, fix in ((torch.bfloat16, "exact"), (torch.float16, "fp32")):
        risky = Policy(compute_dtype=dtype, param_dtype=dtype, allow_unscaled=True)
        (risk,) = risky.risks()
        assert f"use master={fix!r}" in risk
        assert risky.replace(master=fix).risks() == ()


def test_measured_auto_only_chooses_safe_presets() -> None:
    """The candidate set of a measured `auto`: one preset per compute format, each with
    fp32 storage and optimizer state, no risk, and fp16 only with loss scaling."""
    from mixprec.policy import AUTO_CANDIDATES
    from mixprec.speed import CANDIDATE_FORMATS

    assert tuple(AUTO_CANDIDATES) == CANDIDATE_FORMATS
    assert dict(AUTO_CANDIDATES) == {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}
    for fmt, name in AUTO_CANDIDATES.items():
        p = preset(name)
        assert p.risks() == () and p.param_dtype == FP32 and p.moments == "fp32"
        assert p.compute_dtype == (None if fmt == "fp32" else mixprec.dtypes.parse_dtype(fmt))
        assert (p.loss_scaling is not None) == (fmt == "fp16") and not p.allow_unscaled


def test_grad_accum_dtype_is_fp32_or_none_and_reads_from_configs() -> None:
    """Issue 30: the dtype gradients of 16-bit parameters are summed in over a step's
    backward passes; None (the default) keeps today's behaviour (in .grad)."""
    assert preset("bf16_master").grad_accum_dtype is None
    pol = Policy.from_dict({"preset": "bf16_master", "grad_accum_dtype": "fp32"})
    assert pol.grad_accum_dtype == FP32
    assert Policy.from_dict(json.loads(json.dumps(pol.to_dict()))) == pol
    assert Policy.from_dict({"preset": "bf16_master", "grad_accum_dtype": None}) == preset(
        "bf16_master"
    ).replace(name="custom")
    assert "accumulate grads fp32" in pol.describe()
    assert "gradient accumulation over micro-batches: fp32" in mixprec.Precision(pol).summary()
    with pytest.raises(
        ValueError, match=r"grad_accum_dtype=bf16 is not supported; valid: fp32, None \(null\)"
    ):
        preset("bf16_master").replace(grad_accum_dtype=BF16)
    with pytest.raises(TypeError, match="grad_accum_dtype='fp32' is a string"):
        Policy(grad_accum_dtype="fp32")  # type: ignore[arg-type]


def test_differences_name_what_runs_differently_and_read_missing_fields_at_default() -> None:
    """One home for "was this saved under the same policy" (a state, a checkpoint, a run)."""
    bf16 = preset("bf16_master")
    saved = bf16.to_dict()
    assert bf16.differences({**saved, "name": "mine", "note": "renamed"}) == {}
    del saved["grad_accum_dtype"]  # written before the field existed: its default then
    assert bf16.differences(saved) == {}
    amp = preset("amp_bf16").to_dict()
    diff = bf16.differences(amp)
    assert diff["param_dtype"] == (amp["param_dtype"], saved["param_dtype"])
    assert "name" not in diff
