"""Storage formats on their own: tiny updates, stochastic rounding, int8 moments."""

from __future__ import annotations

import torch

from mixprec.optim.formats import master_format
from mixprec.optim.moments import dequantize_signed, dequantize_sqrt, quantize_signed, quantize_sqrt
from mixprec.optim.rng import uniform16

from . import tolerances as tol


def _tiny_updates(kind: str, seed: int = 0) -> float:
    fmt = master_format(kind)
    p = torch.ones(1, dtype=torch.bfloat16)
    state = list(fmt.init_state(p).values())
    for step in range(100):
        value = fmt.decode(p, state) - 1e-4
        noise = uniform16((1,), torch.tensor(seed * 1000 + step)) if fmt.uses_noise else None
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
