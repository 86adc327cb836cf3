"""Bit-exact splitting of fp32 values into a bf16 high part and an integer remainder.

The format: an fp32 bit pattern ``B`` is ``(H << 16) + (L << (16 - w))``
modulo 2**32, where ``H`` is the upper 16 bits rounded to nearest with exact
ties away from zero (a bf16 value) and ``L`` a signed ``w``-bit remainder
(``w = 16`` for the exact master, ``w = 8`` for the 24-bit one, whose low 8
bits are zero). Round-half-to-even cannot be used by a bijective 16+16 split:
an even bf16 value would own 65537 fp32 neighbours within half an ulp.

Two formulations of the one format live here:

* the reference on 16-bit fields (`split_bits`, `merge_bits`): a bijection on
  all 2**32 patterns, NaN payloads included;
* the kernel one (`split_float`, `merge_float`, `round_to_bits`), used by the
  optimizer step: the same integer arithmetic on the int32 view of fp32
  tensors, ``H << 16`` taken as ``B - L``. It agrees with the reference on
  every non-NaN value and turns every NaN into the canonical quiet NaN with a
  zero remainder. All of it is int32 and fp32 elementwise work that Inductor
  vectorizes (with `mixprec.optim.inductor` for the bitcasts).

No int32 arithmetic here overflows: NaNs (the only patterns whose rounding
would leave the int32 range) are canonicalized first, and `merge_float` of a
`split_float` result stays in range (``H = -0`` never comes with ``L < 0``).
"""

from __future__ import annotations

import torch

__all__ = [
    "canonical_bits",
    "merge_bits",
    "merge_float",
    "round_to_bits",
    "split_bits",
    "split_float",
]

_INT32 = torch.int32
_CANONICAL_NAN = 0x7FC00000
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


def canonical_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit patterns of fp32 `x`, every NaN replaced by ``0x7FC00000``."""
    bits = x.view(_INT32)
    return torch.where((bits & _ABS_MASK) > _INF_BITS, _CANONICAL_NAN, bits)


def split_bits(bits: torch.Tensor, *, low_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Split int32 fp32 bit patterns into rounded high bits and a signed remainder.

    The reference formulation, on 16-bit fields.

    Args:
        bits: int32 tensor of fp32 bit patterns (``x.view(torch.int32)``).
        low_bits: width of the remainder, 16 (bf16 + int16) or 8 (bits are first
            expected to be a 24-bit value shifted left by 8; see `round_to_bits`).

    Returns:
        ``(high, low)`` as int32 tensors: ``high`` holds the upper 16 bits of the
        pattern rounded to nearest with ties away from zero (wrapping modulo
        2**16), ``low`` the signed remainder in ``[-2**(w-1), 2**(w-1))`` with
        ``bits == (high << 16) + (low << (16 - w))`` modulo 2**32.
    """
    assert bits.dtype == _INT32
    shift = 16 - low_bits
    top = bits >> shift  # arithmetic shift keeps the sign
    width = 1 << low_bits
    low = ((top & (width - 1)) ^ (width >> 1)) - (width >> 1)  # sign-extend low_bits
    high = ((top >> low_bits) + (low < 0).to(_INT32)) & 0xFFFF
    return high, low


def merge_bits(high: torch.Tensor, low: torch.Tensor, *, low_bits: int = 16) -> torch.Tensor:
    """Inverse of `split_bits`: the int32 fp32 bit patterns (low ``16 - w`` bits zero)."""
    high32 = high.to(_INT32)
    low32 = low.to(_INT32)
    shift = 16 - low_bits
    width = 1 << low_bits
    top_hi = (high32 - (low32 < 0).to(_INT32)) & 0xFFFF
    # Assemble as int64 and wrap to int32 so no signed overflow is relied upon.
    word = (top_hi.to(torch.int64) << 16) | ((low32 & (width - 1)).to(torch.int64) << shift)
    return (((word + 2**31) & 0xFFFFFFFF) - 2**31).to(_INT32)


def round_to_bits(x: torch.Tensor, *, mantissa_bits: int) -> torch.Tensor:
    """Round fp32 values to `mantissa_bits` explicit mantissa bits, nearest-even.

    Integer rounding of the bit pattern (the magnitude bits are contiguous, so
    adding half a unit rounds the magnitude; a carry moves to the next binade
    or to infinity, as it should). Infinities pass through; NaN becomes the
    canonical NaN.
    """
    assert x.dtype == torch.float32 and 0 < mantissa_bits < 23
    drop = 23 - mantissa_bits
    bits = canonical_bits(x)
    lsb = (bits >> drop) & 1
    rounded = (bits + ((1 << (drop - 1)) - 1) + lsb) & -(1 << drop)
    return rounded.view(torch.float32)


def split_float(
    x: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, low_bits: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split of fp32 `x` into a bf16 high part and an int32 remainder.

    Args:
        x: fp32 values; for ``low_bits=8`` their lowest 8 bits are ignored
            (round first with `round_to_bits` to 15 mantissa bits).
        dtype: the 16-bit type of the high part (bf16).
        low_bits: 16 or 8.

    Returns:
        ``(high, low)``: ``high`` in `dtype`, a nearest value to ``x`` with ties
        away from zero (a finite ``x`` above the largest bf16 gives inf with a
        negative remainder); ``low`` int32 in ``[-2**(w-1), 2**(w-1))``.
        NaN gives ``(NaN, 0)``.
    """
    assert x.dtype == torch.float32 and dtype == torch.bfloat16
    shift = 16 - low_bits
    half = 1 << (low_bits - 1)
    bits = canonical_bits(x)
    low = (((bits >> shift) & ((1 << low_bits) - 1)) ^ half) - half
    # The high part's pattern is B minus the remainder (and minus the ignored
    # bits): its low 16 bits are zero, so the bf16 conversion below is exact.
    high_bits = (bits & -(1 << shift)) - low * (1 << shift) if shift else bits - low
    return high_bits.view(torch.float32).to(dtype), low


def merge_float(high: torch.Tensor, low: torch.Tensor, *, low_bits: int = 16) -> torch.Tensor:
    """Inverse of `split_float`: the fp32 value (low ``16 - w`` bits zero).

    Args:
        high: the bf16 high parts.
        low: integer remainders (any integer dtype holding them).
        low_bits: 16 or 8.
    """
    shift = 16 - low_bits
    high_bits = high.to(torch.float32).view(_INT32)
    low32 = low.to(_INT32)
    return (high_bits + (low32 * (1 << shift) if shift else low32)).view(torch.float32)
