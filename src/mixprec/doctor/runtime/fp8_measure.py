"""Pure measurements of fp8 casts: the scale torchao computes, what a cast clips and flushes,
and the scale Transformer Engine's delayed scaling would have used instead.

torchao's float8 training (0.18) casts each operand with a *current* (dynamic)
scale: ``scale = fp8_max / max(amax, 1e-12)`` computed in float64 and rounded to
float32 (`torchao.float8.float8_utils.amax_to_scale`), optionally rounded down to
a power of two (the rowwise recipes), per tensor or per row/column (axiswise);
the cast is ``clamp(x.float() * scale, -max, max).to(fp8)``. Under such a scale
the largest element lands on the format's max, so nothing saturates by
construction. Transformer Engine's ``DelayedScaling`` takes the scale from an
amax *history* instead (``fp8_max / amax / 2**margin``, amax the history's max or
most recent entry, the current tensor's amax recorded only after its cast), so an
outlier larger than anything in the history is clipped: `delayed_scale`
reproduces it as a what-if.

Counting rules (`cast_counts`), on ``v = x.float() * scale`` exactly as torchao
forms it:

* saturated: ``|v|`` beyond the max's rounding interval, ``max + ulp(max)/2``
  (464 for e4m3fn, 61440 for e5m2). Values between the max and that point round
  to the max with or without the clamp, and the amax element of a current-scaled
  cast lands there about one time in nine (the float32 scale rounds up), so
  counting from the max itself would report clipping that loses nothing.
* underflow: non-zero ``x`` with ``|v|`` at or below half the smallest subnormal
  (round-to-nearest-even sends the tie to zero): flushed to zero by the cast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from mixprec.dtypes import dtype_name, format_info

__all__ = [
    "AMAX_EPS",
    "AmaxAlgo",
    "Fp8CastRecord",
    "Fp8CastStats",
    "Fp8Limits",
    "Fp8TensorSample",
    "cast_counts",
    "current_scale",
    "delayed_scale",
    "fp8_limits",
]

#: torchao's floor on the amax before dividing (``torchao.float8.float8_utils.EPS``).
AMAX_EPS = 1e-12

AmaxAlgo = Literal["max", "most_recent"]


@dataclass(frozen=True, kw_only=True)
class Fp8Limits:
    """What the counts compare against for one fp8 format.

    Attributes:
        name: the format's canonical name (``"fp8_e4m3"``).
        max: its largest finite value.
        clip_above: scaled magnitudes above this are saturated (``max + ulp(max) / 2``).
        flush_at_or_below: non-zero scaled magnitudes at or below this are flushed
            (half the smallest subnormal).
    """

    name: str
    max: float
    clip_above: float
    flush_at_or_below: float


def fp8_limits(dtype: torch.dtype) -> Fp8Limits:
    """The limits of an fp8 `dtype` (from `mixprec.dtypes.format_info` where it knows the
    format, else `torch.finfo`).

    Raises:
        ValueError: `dtype` is not a one-byte floating format.
    """
    if not dtype.is_floating_point or dtype.itemsize != 1:
        raise ValueError(f"not an fp8 dtype: {dtype}; give torch.float8_e4m3fn or float8_e5m2")
    try:
        info = format_info(dtype)
        name, fmax, mant, sub = info.name, info.max, info.mantissa_bits, info.smallest_subnormal
    except (TypeError, ValueError):  # a variant the registry lacks (fnuz on ROCm)
        fi = torch.finfo(dtype)
        name, fmax, sub = dtype_name(dtype), float(fi.max), float(fi.smallest_normal) * fi.eps
        mant = round(-math.log2(fi.eps))
    ulp_at_max = 2.0 ** (math.floor(math.log2(fmax)) - mant)
    return Fp8Limits(
        name=name, max=fmax, clip_above=fmax + ulp_at_max / 2, flush_at_or_below=sub / 2
    )


def current_scale(amax: torch.Tensor, *, fp8_max: float, round_pow2: bool) -> torch.Tensor:
    """The scale torchao computes from `amax` (float32, same shape): ``fp8_max /
    max(amax, AMAX_EPS)`` in float64, rounded to float32, then down to a power of two
    when `round_pow2` (as `torchao.float8.float8_utils.amax_to_scale`)."""
    res = (fp8_max / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
    if round_pow2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def delayed_scale(
    history: Sequence[float], *, fp8_max: float, margin: int = 0, algo: AmaxAlgo = "max"
) -> float | None:
    """Transformer Engine's ``DelayedScaling`` scale from an amax history (oldest first).

    ``fp8_max / amax / 2**margin`` with amax the history's max (``"max"``) or its
    last entry (``"most_recent"``). None when there is no history yet, or the amax
    is zero or not finite (TE then keeps the previous scale; with no previous one,
    its initial scale of 1).
    """
    if not history:
        return None
    amax = max(history) if algo == "max" else history[-1]
    if not (amax > 0.0 and math.isfinite(amax)):
        return None
    return fp8_max / amax / 2.0**margin


@dataclass(frozen=True, kw_only=True)
class Fp8CastStats:
    """What one fp8 cast of one tensor does to its elements.

    Attributes:
        elements: elements cast.
        zeros: of those, exactly zero before the cast.
        saturated: elements the cast clips (beyond the max's rounding interval).
        underflow: non-zero elements the cast flushes to zero.
        amax: the tensor's largest magnitude.
        scale_min: the smallest scale used (the only one for a tensorwise cast).
        scale_max: the largest scale used.
    """

    elements: int
    zeros: int
    saturated: int
    underflow: int
    amax: float
    scale_min: float
    scale_max: float

    @property
    def saturated_fraction(self) -> float:
        """Share of the elements clipped."""
        return self.saturated / self.elements if self.elements else 0.0

    @property
    def underflow_fraction(self) -> float:
        """Share of the non-zero elements flushed to zero."""
        nonzero = self.elements - self.zeros
        return self.underflow / nonzero if nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the fractions."""
        return {
            **asdict(self),
            "saturated_fraction": self.saturated_fraction,
            "underflow_fraction": self.underflow_fraction,
        }

    @classmethod
    def from_row(cls, row: Sequence[float]) -> Fp8CastStats:
        """Inverse of the row `cast_counts` returns (read back from the device)."""
        elements, zeros, saturated, underflow, amax, smin, smax = row
        return cls(
            elements=int(elements),
            zeros=int(zeros),
            saturated=int(saturated),
            underflow=int(underflow),
            amax=float(amax),
            scale_min=float(smin),
            scale_max=float(smax),
        )


def cast_counts(x: torch.Tensor, scale: torch.Tensor | float, limits: Fp8Limits) -> torch.Tensor:
    """Count what casting `x` with `scale` to the format of `limits` clips and flushes.

    Args:
        x: the high-precision tensor (any float dtype).
        scale: a float32 tensor broadcastable to `x` (per tensor, row or column), or
            a number.
        limits: the target format (`fp8_limits`).

    Returns:
        A float64 tensor on `x`'s device, ``[elements, zeros, saturated, underflow,
        amax, scale_min, scale_max]`` (`Fp8CastStats.from_row`); nothing is read back,
        so a caller can batch the host transfer.
    """
    xf = x.detach().to(torch.float32)
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
    s = s.to(device=xf.device, dtype=torch.float32)
    v = (xf * s).abs()  # the product torchao forms before its clamp and cast
    nonzero = xf != 0
    n = xf.numel()
    counts = torch.stack(
        [
            torch.tensor(float(n), device=xf.device, dtype=torch.float64),
            (n - torch.count_nonzero(nonzero)).to(torch.float64),
            torch.count_nonzero(v > limits.clip_above).to(torch.float64),
            torch.count_nonzero(nonzero & (v <= limits.flush_at_or_below)).to(torch.float64),
            xf.abs().amax().to(torch.float64)
            if n
            else torch.zeros((), dtype=torch.float64, device=xf.device),
            s.amin().to(torch.float64),
            s.amax().to(torch.float64),
        ]
    )
    return counts


@dataclass(frozen=True, kw_only=True)
class Fp8CastRecord:
    """One cast of a sampled fp8 tensor.

    Attributes:
        gemms: the matmuls that use it (``output``, ``grad_input``, ``grad_weight``).
        granularity: ``tensorwise`` or ``axiswise`` (one scale per row/column).
        stats: what the cast did, under the scale torchao computed for it.
    """

    gemms: tuple[str, ...]
    granularity: str
    stats: Fp8CastStats

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "gemms": list(self.gemms),
            "granularity": self.granularity,
            **self.stats.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Fp8TensorSample:
    """One tensor of one fp8 layer on one sampled step.

    Attributes:
        step: the step.
        layer: the layer's qualified name.
        role: ``input``, ``weight`` or ``grad_output``.
        format: the fp8 format it is cast to (``"fp8_e4m3"``).
        recipe: the layer's recipe (`mixprec.doctor.runtime.fp8_layers.Fp8Layer.recipe`).
        casts: its casts under the layer's own (current) scaling: measured.
        delayed: the what-if: the same tensor cast with Transformer Engine's delayed
            scale from the amax history before this sample (None without history).
        delayed_scale: that scale (None without history).
        history: the amax history after this sample (oldest first, bounded).
        samples: how many sampled steps have measured this tensor, this one included.
    """

    step: int
    layer: str
    role: str
    format: str
    recipe: str
    casts: tuple[Fp8CastRecord, ...]
    delayed: Fp8CastStats | None
    delayed_scale: float | None
    history: tuple[float, ...]
    samples: int

    @property
    def amax(self) -> float:
        """The tensor's largest magnitude on this step."""
        return max((c.stats.amax for c in self.casts), default=0.0)

    @property
    def saturated_fraction(self) -> float:
        """The largest clipped share over its casts (measured)."""
        return max((c.stats.saturated_fraction for c in self.casts), default=0.0)

    @property
    def underflow_fraction(self) -> float:
        """The largest flushed share over its casts (measured)."""
        return max((c.stats.underflow_fraction for c in self.casts), default=0.0)

    @property
    def delayed_saturated_fraction(self) -> float:
        """The clipped share under the delayed-scaling what-if (0.0 without one)."""
        return self.delayed.saturated_fraction if self.delayed is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "step": self.step,
            "layer": self.layer,
            "role": self.role,
            "format": self.format,
            "recipe": self.recipe,
            "amax": self.amax,
            "casts": [c.to_dict() for c in self.casts],
            "delayed_what_if": None if self.delayed is None else self.delayed.to_dict(),
            "delayed_scale": self.delayed_scale,
            "amax_history": list(self.history),
            "samples": self.samples,
        }
