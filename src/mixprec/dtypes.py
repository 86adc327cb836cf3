"""Floating-point formats: the one place where strings become `torch.dtype`.

Everything else in mixprec takes real `torch.dtype` values. Strings from
configs, the command line and other tools' spellings are turned into dtypes
here, by `parse_dtype`, and nowhere else.

The format facts (`format_info`) are read from `torch.finfo` so they stay true
to what PyTorch actually computes with; nothing here is a hand-typed literal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "FORMAT_NAMES",
    "FP8_DTYPES",
    "HALF_DTYPES",
    "DtypeLike",
    "FormatInfo",
    "dtype_name",
    "format_info",
    "is_16bit",
    "is_fp8",
    "min_update_at",
    "parse_dtype",
    "round_trip",
    "ulp",
]

DtypeLike = torch.dtype | str

#: The 16-bit floating formats used for storage and compute.
HALF_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})

#: The 8-bit floating formats PyTorch provides (OCP "fn" variants and AMD "fnuz").
FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)

# Canonical short name of each dtype, used in tables, JSON and error messages.
_CANONICAL: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
    torch.float8_e5m2fnuz: "fp8_e5m2fnuz",
}

# Every accepted spelling (lower case, no "torch." prefix) to its dtype.
_SPELLINGS: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "64": torch.float64,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "f32": torch.float32,
    "32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bfloat": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "f16": torch.float16,
    "16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
    "e5m2": torch.float8_e5m2,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
}

#: The formats `format_info` and `mixprec formats` describe, in table order.
FORMAT_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


def parse_dtype(value: DtypeLike) -> torch.dtype:
    """Turn a dtype or one of its common spellings into a floating `torch.dtype`.

    Accepts `torch.dtype` values and strings such as ``"bf16"``, ``"bfloat16"``,
    ``"torch.bfloat16"``, ``"fp16"``, ``"half"``, ``"fp32"``, ``"float32"``,
    ``"32"``, ``"fp8_e4m3"`` and ``"fp8_e5m2"`` (case and surrounding space are
    ignored; ``-`` and ``_`` are interchangeable).

    Raises:
        ValueError: for an unknown spelling or a non-floating dtype, naming the
            value and the accepted spellings.
        TypeError: for a value that is neither a string nor a `torch.dtype`.
    """
    if isinstance(value, torch.dtype):
        if value not in _CANONICAL:
            raise ValueError(
                f"unsupported dtype {value}: mixprec handles floating formats "
                f"{sorted(_CANONICAL.values())}"
            )
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"expected a torch.dtype or a string, got {type(value).__name__}: {value!r}"
        )
    key = value.strip().lower().replace("-", "_")
    key = key.removeprefix("torch.")
    if key in _SPELLINGS:
        return _SPELLINGS[key]
    raise ValueError(f"unknown dtype {value!r}; valid spellings: {', '.join(sorted(_SPELLINGS))}")


def dtype_name(dtype: torch.dtype | None) -> str:
    """The canonical short name of a dtype (``"bf16"``, ``"fp32"``...), ``"none"`` for None."""
    if dtype is None:
        return "none"
    return _CANONICAL.get(dtype, str(dtype).removeprefix("torch."))


def is_16bit(dtype: torch.dtype | None) -> bool:
    """True for fp16 and bf16."""
    return dtype in HALF_DTYPES


def is_fp8(dtype: torch.dtype | None) -> bool:
    """True for the 8-bit floating formats."""
    return dtype in FP8_DTYPES


@dataclass(frozen=True, kw_only=True)
class FormatInfo:
    """Facts about one floating-point format that matter for training.

    Attributes:
        name: canonical short name (``"bf16"``).
        dtype: the `torch.dtype`.
        bits: total storage bits.
        exponent_bits: bits of exponent.
        mantissa_bits: explicitly stored fraction bits.
        eps: machine epsilon, the gap between 1.0 and the next larger value.
        smallest_subnormal: the smallest positive value (0 if the format has no
            subnormals).
        smallest_normal: the smallest positive normal value; below it precision
            is lost progressively until values flush to zero.
        max: the largest finite value; above it values become inf (or NaN for
            formats without inf).
        min_update_at_one: an update added to a weight of 1.0 must be larger than
            this to change the stored weight (round to nearest even: ``eps / 2``).
        decimal_digits: about how many significant decimal digits the format keeps.
        dynamic_range_log2: ``log2(max / smallest_subnormal)``, the span of
            magnitudes in binary orders of magnitude.
    """

    name: str
    dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int
    eps: float
    smallest_subnormal: float
    smallest_normal: float
    max: float
    min_update_at_one: float
    decimal_digits: float
    dynamic_range_log2: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the dtype as its canonical name)."""
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out

    def training_meaning(self) -> str:
        """What the format's limits mean for training, in one line.

        Example:
            >>> format_info("bf16").training_meaning().split(";")[0]
            'an update under 0.39% of a weight is lost'
        """
        parts = [f"an update under {self.min_update_at_one * 100:.2g}% of a weight is lost"]
        if self.max < torch.finfo(torch.float32).max / 2**8:
            parts.append(f"values above {self.max:g} overflow")
            parts.append(
                f"gradients below {self.smallest_subnormal:.2g} flush to 0: scale the loss"
            )
        else:
            parts.append("fp32's range: no loss scaling needed")
        return "; ".join(parts)


def format_info(dtype: DtypeLike) -> FormatInfo:
    """Facts about a floating format, computed from `torch.finfo`.

    Example:
        >>> format_info("bf16").mantissa_bits
        7
    """
    dt = parse_dtype(dtype)
    fi = torch.finfo(dt)
    mantissa_bits = round(-math.log2(fi.eps))
    exponent_bits = fi.bits - 1 - mantissa_bits
    # The smallest subnormal is one unit in the last place at the smallest normal exponent.
    smallest_subnormal = fi.smallest_normal * fi.eps
    return FormatInfo(
        name=dtype_name(dt),
        dtype=dt,
        bits=fi.bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        eps=float(fi.eps),
        smallest_subnormal=float(smallest_subnormal),
        smallest_normal=float(fi.smallest_normal),
        max=float(fi.max),
        min_update_at_one=float(fi.eps) / 2.0,
        decimal_digits=(mantissa_bits + 1) * math.log10(2.0),
        dynamic_range_log2=math.log2(float(fi.max) / float(smallest_subnormal)),
    )


def round_trip(x: torch.Tensor, dtype: DtypeLike) -> torch.Tensor:
    """`x` rounded to `dtype` (round to nearest even) and brought back to x's dtype."""
    return x.to(parse_dtype(dtype)).to(x.dtype)


def ulp(x: torch.Tensor, dtype: DtypeLike) -> torch.Tensor:
    """The unit in the last place of each value of `x` once stored in `dtype`, in fp64.

    The ulp of a normal value ``v`` with exponent ``e`` is ``eps * 2**e``; below the
    smallest normal it is the smallest subnormal. Non-finite inputs give NaN.
    """
    info = format_info(dtype)
    v = round_trip(x.to(torch.float64), dtype).abs()
    _, exponent = torch.frexp(v)  # v = m * 2**exponent with m in [0.5, 1)
    out = torch.ldexp(torch.full_like(v, info.eps), (exponent - 1).to(torch.int32))
    out = torch.where(v < info.smallest_normal, torch.full_like(v, info.smallest_subnormal), out)
    return torch.where(torch.isfinite(v), out, torch.full_like(v, math.nan))


def min_update_at(weight: float, dtype: DtypeLike) -> float:
    """The largest update magnitude that is lost when added to `weight` stored in `dtype`.

    Under round to nearest even an update `u` changes a stored weight `w` only if
    ``|u| > ulp(w) / 2`` (at exactly half an ulp it ties back to w when w's last bit
    is even). This is the 16-bit "swallowed update" threshold.
    """
    w = torch.tensor([weight], dtype=torch.float64)
    return float(ulp(w, dtype)[0]) / 2.0
