"""Storage formats on their own: tiny updates, stochastic rounding, int8 moments."""

from __future__ import annotations

import pytest
import torch

import tolerances as tol
from mixprec.formats import master_format
from mixprec.formats.masters import stochastic_round
from mixprec.formats.moments import (
    dequantize_signed,
    dequantize_sqrt,
    quantize_signed,
    quantize_sqrt,
)
from mixprec.optim.inductor import compile_fn
from mixprec.optim.rng import uniform16


def _tiny_updates(kind: str, seed: int = 0) -> float:
    fmt = master_format(kind)
    p = torch.ones(1, dtype=torch.bfloat16)
    state = list(fmt.init_state(p).values())
    for step in range(100):
        value = fmt.decode(p, state) - 1e-4
        noise = uniform16((1,), torch.tensor(seed * 1000 + step)) if fmt.spec.uses_noise else None
        p, new_state = fmt.encode(value, dtype=torch.bfloat16, noise=noise)
        state = list(new_state)
    return float(fmt.decode(p, state)[0])


def test_tiny_updates_none_is_stuck_and_masters_track_fp32() -> None:
    want = 1.0
    for _ in range(100):
        want = float(torch.tensor(want, dtype=torch.float32) - 1e-4)
    assert _tiny_updates("none") == 1.0
    for kind, rel in tol.TINY_UPDATE_REL.items():
        assert abs(_tiny_updates(kind) - want) / (1.0 - want) <= rel, kind
    mean = sum(_tiny_updates("stochastic", seed) for seed in range(64)) / 64
    assert abs(mean - want) / (1.0 - want) <= tol.STOCHASTIC_TINY_REL


def test_stochastic_rounding_is_unbiased() -> None:
    fmt = master_format("stochastic")
    value = torch.full((1 << 20,), 1.0 + 3e-3, dtype=torch.float32)
    noise = uniform16(value.shape, torch.tensor(12345))
    rounded, _ = fmt.encode(value, dtype=torch.bfloat16, noise=noise)
    mean = rounded.double().mean().item()
    assert abs(mean - float(value[0])) / float(value[0]) <= tol.STOCHASTIC_MEAN_REL
    assert len(set(rounded.float().tolist())) == 2  # the two neighbours only


def test_stochastic_rounding_picks_a_neighbour_by_the_low_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=gen) * torch.logspace(-30, 30, 100_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    low = x.view(torch.int32) & 0xFFFF
    toward_zero = (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    away = (toward_zero.view(torch.int16) + 1).view(torch.bfloat16)  # next magnitude up
    for noise_value in (0, 1, 32768, 65535):
        noise = torch.full_like(low, noise_value)
        got = stochastic_round(x, noise, dtype=torch.bfloat16)
        up = low + noise_value >= 65536  # the carry: probability low / 65536
        finite = torch.isfinite(x) & (x != 0)
        want = torch.where(up, away, toward_zero)
        assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
        assert torch.equal(got[~finite][:4].float(), x[~finite][:4])  # zeros and infinities
        assert bool(torch.isnan(got[-1]))


def test_int8_moments_keep_relative_precision_and_never_flush_v() -> None:
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(64, 256, generator=gen) * torch.logspace(-6, 0, 256)
    codes, absmax = quantize_signed(m)
    back = dequantize_signed(codes, absmax)
    big = m.abs() >= 0.01 * absmax[:, None]
    assert ((back - m).abs() / m.abs())[big].max() <= tol.INT8_EXP_AVG_REL_AT_1PCT
    v = torch.rand(64, 256, generator=gen) * torch.logspace(-12, 0, 256)
    vcodes, umax = quantize_sqrt(v)
    vback = dequantize_sqrt(vcodes, umax)
    assert bool((vback > 0).all())  # nothing flushed to zero
    big_v = v >= 1e-4 * (umax**2)[:, None]
    rel = (vback.sqrt() - v.sqrt()).abs() / v.sqrt()
    assert rel[big_v].max() <= tol.INT8_SQRT_EXP_AVG_SQ_REL_AT_1E4


@pytest.mark.compile
def test_compiled_int8_quantizers_equal_eager() -> None:
    gen = torch.Generator().manual_seed(2)
    scale = torch.logspace(-20, 20, 4096)[:, None]
    m = torch.randn(4096, 256, generator=gen) * scale
    v = torch.rand(4096, 256, generator=gen) * torch.logspace(-12, 0, 256) * scale
    m[0] = 0.0
    v[1] = 0.0

    def round_trip(m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m_codes, m_absmax = quantize_signed(m)
        v_codes, v_umax = quantize_sqrt(v)
        back_m = dequantize_signed(m_codes, m_absmax)
        back_v = dequantize_sqrt(v_codes, v_umax)
        return m_codes, m_absmax, v_codes, v_umax, back_m, back_v

    for got, want in zip(compile_fn(round_trip)(m, v), round_trip(m, v), strict=True):
        assert torch.equal(got, want)
