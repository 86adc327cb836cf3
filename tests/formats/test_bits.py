"""The bit split: reference round trip, kernel formulation agreement, rounding rules."""

from __future__ import annotations

import pytest
import torch

from mixprec.formats.bits import merge_bits, merge_float, round_to_bits, split_bits, split_float
from mixprec.formats.masters import stochastic_round
from mixprec.optim.inductor import compile_fn

_SPECIAL = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x00000001, 0x80000001, 0x00008000, 0x00018000,
    0x007FFFFF, 0x00800000, 0x0080FFFF, 0x3F808000, 0x3F818000, 0x3F7F8000, 0xBF808000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F7FFFFF,
]  # fmt: skip


def _patterns(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    special = torch.tensor(_SPECIAL, dtype=torch.int64)
    return (((torch.cat([special, rand]) + 2**31) & 0xFFFFFFFF) - 2**31).to(torch.int32)


def test_bits_round_trip_exact_on_all_kinds_of_patterns() -> None:
    bits = _patterns(4_000_000)
    high, low = split_bits(bits)
    assert int(high.min()) >= 0 and int(high.max()) <= 0xFFFF
    assert int(low.min()) >= -32768 and int(low.max()) <= 32767
    assert torch.equal(merge_bits(high, low), bits)


def test_kernel_split_agrees_with_reference_and_canonicalizes_nan() -> None:
    bits = _patterns(2_000_000, seed=1)
    x = bits.view(torch.float32)
    nan = torch.isnan(x)
    ref_high, ref_low = split_bits(bits)
    high, low = split_float(x)
    high_bits = high.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(high_bits[~nan], ref_high[~nan])
    assert torch.equal(low[~nan].to(torch.int32), ref_low[~nan])
    back = merge_float(high, low)
    assert torch.equal(back.view(torch.int32)[~nan], bits[~nan])
    assert bool(torch.isnan(high[nan]).all()) and bool((low[nan] == 0).all())
    assert bool(torch.isnan(back[nan]).all())  # bf16 conversions pick their own NaN


def test_high_part_is_a_nearest_bf16_with_ties_away() -> None:
    bits = _patterns(1_000_000, seed=2)
    x = bits.view(torch.float32)
    ok = torch.isfinite(x)
    high, _ = split_float(x)
    rne = x.to(torch.bfloat16)
    err = (high.double() - x.double()).abs()
    err_rne = (rne.double() - x.double()).abs()
    finite = ok & torch.isfinite(high)
    assert bool((err[finite] == err_rne[finite]).all())
    differs = finite & (high.view(torch.int16) != rne.view(torch.int16))
    assert bool(((bits[differs] & 0xFFFF) == 0x8000).all())  # only at exact ties
    assert bool((high.double().abs()[differs] > rne.double().abs()[differs]).all())
    tie = torch.tensor([0x3F808000, 0xBF808000 - 2**32, 0x3F818000], dtype=torch.int32)
    high_tie, low_tie = split_float(tie.view(torch.float32))
    assert high_tie.view(torch.int16).tolist() == [0x3F81, -16511, 0x3F82]
    assert low_tie.tolist() == [-32768, -32768, -32768]


def test_round_to_24_bits_is_nearest_even_and_splits_into_bf16_plus_int8() -> None:
    bits = _patterns(1_000_000, seed=3)
    x = bits.view(torch.float32)
    x24 = round_to_bits(x, mantissa_bits=15)
    ok = ~torch.isnan(x)
    b24 = x24.view(torch.int32)
    assert bool(((b24[ok] & 0xFF) == 0).all())
    # Reference: nearest-even on the bit pattern's low byte.
    low8 = bits & 0xFF
    up = (low8 > 0x80) | ((low8 == 0x80) & (((bits >> 8) & 1) == 1))
    ref = ((bits.to(torch.int64) & ~0xFF) + up.to(torch.int64) * 0x100).to(torch.int32)
    finite = ok & torch.isfinite(x)
    assert torch.equal(b24[finite], ref[finite])
    high, low = split_float(x24, low_bits=8)
    ref_high, ref_low = split_bits(b24, low_bits=8)
    ok24 = ~torch.isnan(x24)
    assert torch.equal((high.view(torch.int16).to(torch.int32) & 0xFFFF)[ok24], ref_high[ok24])
    assert torch.equal(low.to(torch.int32)[ok24], ref_low[ok24])
    assert torch.equal(merge_bits(ref_high, ref_low, low_bits=8)[ok24], b24[ok24])
    assert torch.equal(merge_float(high, low, low_bits=8).view(torch.int32)[ok24], b24[ok24])


@pytest.mark.compile
def test_compiled_bit_functions_equal_eager_on_all_kinds_of_patterns() -> None:
    def bit_functions(x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, ...]:
        high, low = split_float(x)
        x24 = round_to_bits(x, mantissa_bits=15)
        high8, low8 = split_float(x24, low_bits=8)
        merged8 = merge_float(high8, low8, low_bits=8)
        sr = stochastic_round(x, noise, dtype=torch.bfloat16)
        return high, low, merge_float(high, low), x24, high8, low8, merged8, sr

    bits = _patterns(1_000_003, seed=4)
    x = bits.view(torch.float32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(5))
    got = compile_fn(bit_functions)(x, noise)
    want = bit_functions(x, noise)
    for g, w in zip(got, want, strict=True):
        # NaN: the scalar and vector bf16 conversions pick different NaN patterns
        nan = torch.isnan(w) if w.is_floating_point() else torch.zeros_like(w, dtype=torch.bool)
        assert torch.equal(torch.isnan(g) if g.is_floating_point() else nan, nan)
        as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(g.dtype)
        if as_int is not None:
            g, w = g.view(as_int), w.view(as_int)
        assert torch.equal(g[~nan], w[~nan])
    assert torch.equal(got[2].view(torch.int32)[~torch.isnan(x)], bits[~torch.isnan(x)])
