"""Round trips of torchao's float8 casts (the ones ``Float8Linear`` uses) against float64.

``hp_tensor_to_float8_dynamic`` scales a tensor by ``max / amax`` (per tensor or per
row, optionally rounded down to a power of two) and casts with saturation
(``to_fp8_saturated``); ``hp_tensor_and_scale_to_float8`` casts with a given scale.
The format facts come from `mixprec.floats` (what ``mixprec formats`` prints).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.tolerances import FP8_CAST_FP32_SLACK, FP8_IN_RANGE_MIN_SHARE

from mixprec.floats import float_format

pytest.importorskip("torchao.float8")

from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import (
    LinearMMConfig,
    hp_tensor_and_scale_to_float8,
)

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

#: (granularity, axiswise dim, scales rounded to a power of two): the three casts the
#: recipes use (tensorwise; rowwise and rowwise_with_gw_hp round scales to powers of 2).
CASTS = {
    "tensorwise": (ScalingGranularity.TENSORWISE, None, False),
    "rowwise": (ScalingGranularity.AXISWISE, -1, True),
    "rowwise_exact_scale": (ScalingGranularity.AXISWISE, -1, False),
}


def _draw(fmt: str, rows: int = 64, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """float64 values spread log-uniformly over 95% of the format's normal range (in
    octaves, below each row's amax), random signs, rows of very different scales."""
    info = float_format(fmt)
    octaves = math.log2(info.max / info.smallest_normal)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 0.95 * octaves
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0).double()
    row_scale = torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).double())
    x = sign * torch.exp2(-u) * row_scale
    x[:, 0] = row_scale[:, 0]  # each row's amax is its scale
    return x


def _cast(
    x64: torch.Tensor, fmt: str, cast: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    granularity, dim, pow2 = CASTS[cast]
    t = hp_tensor_to_float8_dynamic(
        x64.float(),
        FORMATS[fmt],
        LinearMMConfig(),
        scaling_granularity=granularity,
        axiswise_dim=dim,
        round_scales_to_power_of_2=pow2,
    )
    scale = t._scale.double().expand_as(x64)
    return t.to_original_precision().double(), scale, t._data.double()


@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_half_an_epsilon_in_range(fmt: str, cast: str) -> None:
    info = float_format(fmt)
    x = _draw(fmt)
    if cast == "tensorwise":  # one scale: keep rows within the range together
        x = x / x.abs().amax(dim=1, keepdim=True)
    back, scale, _ = _cast(x, fmt, cast)
    scaled = x.abs() * scale
    in_range = scaled >= info.smallest_normal
    assert in_range.double().mean() >= FP8_IN_RANGE_MIN_SHARE
    rel = ((back - x).abs() / x.abs())[in_range]
    # round to nearest: at most half a spacing, relative to the value (worst just above a
    # power of two: u / (1 + u) with u = eps / 2), and no more than the format's eps
    u = info.eps / 2
    bound = u / (1 + u) + FP8_CAST_FP32_SLACK
    assert bound < info.eps
    assert rel.max().item() <= bound, (rel.max().item(), bound)
    assert rel.max().item() >= 0.95 * u / (1 + u)  # the cast really keeps only those bits
    # below the normal range (subnormals): absolute error of half a subnormal, scaled back
    tail = ~in_range
    if tail.any():
        abs_err = ((back - x).abs() * scale)[tail]
        assert abs_err.max().item() <= info.smallest_subnormal / 2 * (1 + 1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dynamic_scaling_maps_amax_to_the_max_and_saturates_nothing(fmt: str) -> None:
    info = float_format(fmt)
    x = _draw(fmt)
    _, _, data = _cast(x, fmt, "rowwise_exact_scale")
    assert torch.equal(data.abs().amax(dim=1), torch.full((x.shape[0],), info.max))
    # nothing was clipped: every value is at most half a spacing from its scaled value
    # (checked in range above); here: no value rounds to the max unless within half a
    # spacing of it
    scaled = x.abs() * (info.max / x.abs().amax(dim=1, keepdim=True))
    at_max = data.abs() == info.max
    assert bool((scaled[at_max] >= info.max * (1 - info.eps / 2) * (1 - 1e-6)).all())
    _, _, data = _cast(x, fmt, "rowwise")  # power-of-two scales: amax lands in (max/2, max]
    top = data.abs().amax(dim=1)
    assert bool(((top > info.max / 2) & (top <= info.max)).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_beyond_the_max_saturate_at_it(fmt: str) -> None:
    info = float_format(fmt)
    top = info.max
    x = torch.tensor(
        [top, top * (1 + info.eps / 4), top * 1.5, top * 1e3, 1e30, -top * 2, -1e30],
        dtype=torch.float64,
    )
    t = hp_tensor_and_scale_to_float8(x.float(), torch.tensor(1.0), FORMATS[fmt])
    back = t.to_original_precision().double()
    assert back.tolist() == [top] * 5 + [-top] * 2
    assert bool(torch.isfinite(back).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_below_half_the_smallest_subnormal_flush_to_zero(fmt: str) -> None:
    info = float_format(fmt)
    sub = info.smallest_subnormal
    below = torch.tensor([sub * f for f in (1e-6, 0.1, 0.3, 0.49, 0.5)], dtype=torch.float64)
    above = torch.tensor([sub * f for f in (0.51, 0.75, 1.0, 1.2)], dtype=torch.float64)
    x = torch.cat([below, above, -below, -above])
    t = hp_tensor_and_scale_to_float8(x.float(), torch.tensor(1.0), FORMATS[fmt])
    back = t.to_original_precision().double()
    n = len(below)
    # half a subnormal is a tie: it rounds to the even neighbour, zero
    assert back[:n].abs().max().item() == 0.0
    assert back[n : n + len(above)].tolist() == [sub] * len(above)
    assert back[2 * n + len(above) :].tolist() == [-sub] * len(above)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_format_facts_are_torchs(fmt: str) -> None:
    info, finfo = float_format(fmt), torch.finfo(FORMATS[fmt])
    assert (info.max, info.smallest_normal, info.eps) == (finfo.max, finfo.tiny, finfo.eps)
    assert info.smallest_subnormal == finfo.smallest_normal * finfo.eps
