from __future__ import annotations

import math

import pytest
import torch

from mixprec.dtypes import (
    FORMAT_NAMES,
    dtype_name,
    format_info,
    is_16bit,
    is_fp8,
    min_update_at,
    parse_dtype,
    ulp,
)


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        (" BF16 ", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("32", torch.float32),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8-e4m3", torch.float8_e4m3fn),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
        ("e5m2", torch.float8_e5m2),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype_spellings(spelling: str | torch.dtype, dtype: torch.dtype) -> None:
    assert parse_dtype(spelling) is dtype


def test_parse_dtype_rejects_unknown_with_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'bf17'.*valid spellings:.*bf16"):
        parse_dtype("bf17")
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int8"):
        parse_dtype(torch.int8)
    with pytest.raises(TypeError, match=r"expected a torch\.dtype or a string"):
        parse_dtype(16)  # type: ignore[arg-type]


def test_dtype_name_round_trips_through_parse() -> None:
    for name in FORMAT_NAMES:
        assert dtype_name(parse_dtype(name)) == name
    assert dtype_name(None) == "none"


def test_format_facts_follow_finfo() -> None:
    for name in FORMAT_NAMES:
        info = format_info(name)
        fi = torch.finfo(info.dtype)
        assert info.eps == fi.eps
        assert info.max == fi.max
        assert info.smallest_normal == fi.smallest_normal
        assert info.bits == fi.bits
        assert 1 + info.exponent_bits + info.mantissa_bits == info.bits


# Closed-form values of IEEE-style formats (bits: exponent, mantissa), checked against
# the finfo-derived facts: smallest subnormal = 2**(1 - bias - mantissa).
@pytest.mark.parametrize(
    ("name", "exp_bits", "man_bits", "subnormal_log2"),
    [
        ("fp32", 8, 23, -149),
        ("bf16", 8, 7, -133),
        ("fp16", 5, 10, -24),
        ("fp8_e4m3", 4, 3, -9),
        ("fp8_e5m2", 5, 2, -16),
    ],
)
def test_format_bits_and_subnormals(
    name: str, exp_bits: int, man_bits: int, subnormal_log2: int
) -> None:
    info = format_info(name)
    assert (info.exponent_bits, info.mantissa_bits) == (exp_bits, man_bits)
    assert info.smallest_subnormal == 2.0**subnormal_log2
    # The smallest subnormal is representable and half of it rounds to zero.
    t = torch.tensor([info.smallest_subnormal, info.smallest_subnormal / 2], dtype=torch.float64)
    got = t.to(info.dtype).to(torch.float64)
    assert got[0].item() == info.smallest_subnormal
    assert got[1].item() == 0.0


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_min_update_at_one_is_the_survival_threshold(name: str) -> None:
    info = format_info(name)
    one = torch.tensor(1.0, dtype=torch.float64)
    # Exactly half an ulp ties back to 1.0 (1.0 has an even last bit); just above survives.
    at = (one + info.min_update_at_one).to(info.dtype).item()
    above = (one + info.min_update_at_one * (1 + 2**-10)).to(info.dtype).item()
    assert at == 1.0
    assert above > 1.0
    assert min_update_at(1.0, name) == info.min_update_at_one


def test_ulp_matches_nextafter() -> None:
    x = torch.tensor([1.0, 1.5, 3.0, -7.25, 1e-3, 1e-30], dtype=torch.float32)
    got = ulp(x, "fp32")
    nxt = torch.nextafter(x.abs(), torch.tensor(math.inf)) - x.abs()
    assert torch.equal(got, nxt.to(torch.float64))
    sub = ulp(torch.tensor([1e-45, 0.0]), "fp32")
    assert sub.tolist() == [2.0**-149, 2.0**-149]
    assert math.isnan(ulp(torch.tensor([math.inf]), "bf16").item())


def test_predicates() -> None:
    assert is_16bit(torch.bfloat16) and is_16bit(torch.float16)
    assert not is_16bit(torch.float32) and not is_16bit(None)
    assert is_fp8(torch.float8_e4m3fn) and not is_fp8(torch.bfloat16)


def test_format_info_to_dict_is_json_ready() -> None:
    import json

    d = format_info("bf16").to_dict()
    assert json.loads(json.dumps(d))["dtype"] == "bfloat16"
