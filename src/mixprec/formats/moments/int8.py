"""Moment format ``int8``: blockwise 8-bit codes with one fp32 scale per block.

Flattened moments are cut into blocks of `block_size` elements; only
parameters whose size is a multiple of `block_size` use this format (the
optimizer keeps fp32 moments for the others). Per block:

* ``exp_avg`` (signed) is stored as ``q = round(sqrt(|m| * 127**2 / absmax))``
  (that is ``127 * sqrt(|m| / absmax)``) with m's sign, an int8 code, and
  ``absmax`` in fp32. Decoding gives
  ``absmax * sign(q) * (q / 127)**2``. Square-root companding keeps relative
  precision for values well below the block maximum.
* ``exp_avg_sq`` is stored through ``u = sqrt(v)`` (halving its dynamic range)
  as ``q = round(sqrt(u * 255**2 / umax))``, a uint8 code, with ``umax`` in fp32,
  so ``v = (umax * (q / 255)**2)**2``: a quarter-power map reaching
  ``(1/255)**4 = 2.4e-10`` of the block's largest v. A nonzero v that would
  round to code 0 is stored as code 1: the second moment is never flushed to
  zero, which would turn ``m / (sqrt(v) + eps)`` into a huge step. ``u`` is
  stored at most `U_MAX` (an overflowing v would otherwise poison its block), and
  ``|m|`` at most `M_MAX`, so that ``|m| / sqrt(v)`` stays at most 1 where v is
  capped (a capped v with an uncapped m made a step of about 1e12).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.moments.base import Slots
from mixprec.formats.registry import register_moments
from mixprec.formats.spec import MomentSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "M_MAX",
    "SPEC",
    "U_MAX",
    "Int8Moments",
    "dequantize_signed",
    "dequantize_sqrt",
    "quantize_signed",
    "quantize_sqrt",
]

#: The registry entry of ``int8``.
SPEC = MomentSpec(
    name="int8",
    summary="blockwise 8-bit codes with one fp32 scale per block (square-root companded)",
    signed=(StateTensor("{}_i8", "int8"), StateTensor("{}_absmax", "fp32", per_block=True)),
    square=(StateTensor("{}_u8", "uint8"), StateTensor("{}_absmax", "fp32", per_block=True)),
    rounds_increments=False,
    blockwise=True,
    kernel_code=2,
)

_INV_127_SQ = 1.0 / (127.0 * 127.0)
_INV_255_SQ = 1.0 / (255.0 * 255.0)


def _safe(absmax: torch.Tensor) -> torch.Tensor:
    import torch  # (see moments/__init__: specs load without torch)

    return torch.where(absmax > 0, absmax, torch.ones_like(absmax))


# Both quantizers multiply by a per-block factor (code_max**2 / block max)
# before their one square root per element, instead of dividing each element
# by the block max: division and square root are the step's slowest ops, and a
# scalar square root per block inside Inductor's inner loop costs more than the
# element work (-fmath-errno keeps it from being hoisted). The factor is spelled
# reciprocal-then-multiply, which is what ``c / x`` means for a tensor ``x``
# anyway (`Tensor.__rtruediv__`), so that nobody "simplifies" it into one division.


def quantize_signed(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks ``(num_blocks, block_size)`` to (int8 codes, fp32 per-block absmax);
    ``|m|`` is stored at most `M_MAX` (NaN stays NaN)."""
    import torch

    from mixprec.formats.rounding import sqrt_rn

    xb = xb.clamp(-M_MAX, M_MAX)
    absmax = xb.abs().amax(dim=1)
    factor = torch.reciprocal(_safe(absmax)) * (127.0 * 127.0)
    q = torch.round(sqrt_rn(xb.abs() * factor[:, None]))
    return torch.where(xb < 0, -q, q).to(torch.int8), absmax


def dequantize_signed(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_signed` (up to the quantization error)."""
    import torch

    q = codes.to(torch.float32)
    return (q * q.abs()) * (absmax * _INV_127_SQ)[:, None]


#: Largest sqrt(v) stored. A gradient element near fp32's range (1e21, say) makes v
#: overflow to inf; an inf block maximum would decode every other element of its block
#: to NaN (inf * 0). Storing at most 2**63 keeps the decoded v = u**2 finite, with room
#: for the decode's rounding (2**64 would square to inf). Finite moments never reach it.
U_MAX = 2.0**63

#: Largest |m| stored: the largest sqrt(v) stored. The gradient that overflows v to inf
#: (capped at U_MAX**2) leaves m near its own size (0.1 * 1e36, say), and the next
#: step's m / sqrt(v) would be about 1e16; capping m as well keeps it at most 1 there,
#: a normal Adam step (fp32 moments freeze that element: m / inf). Only a gradient
#: above 2**63 (9.2e18) makes an m that large.
M_MAX = U_MAX


def quantize_sqrt(vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative fp32 blocks to (uint8 codes, fp32 per-block max of sqrt(v))."""
    import torch

    from mixprec.formats.rounding import sqrt_rn

    ub = sqrt_rn(vb)  # the same expression as the update's root: compiled, it is shared
    ub = torch.where(ub > U_MAX, U_MAX, ub)  # NaN stays NaN, as in the native kernel
    umax = ub.amax(dim=1)
    factor = torch.reciprocal(_safe(umax)) * (255.0 * 255.0)
    q = torch.round(sqrt_rn(ub * factor[:, None]))
    q = torch.where((q == 0) & (ub > 0), torch.ones_like(q), q)
    return q.to(torch.uint8), umax


def dequantize_sqrt(codes: torch.Tensor, umax: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_sqrt` (up to the quantization error)."""
    import torch

    q = codes.to(torch.float32)
    ub = (q * q) * (umax * _INV_255_SQ)[:, None]
    return ub * ub


@dataclass(frozen=True)
class Int8Moments:
    """Blockwise-quantized moments (see module docs)."""

    spec: ClassVar[MomentSpec] = SPEC
    block_size: int = 256

    def scale_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the per-block scales of a parameter of `shape`.

        Blocks run along the flattened parameter. When every row (dim 0) holds
        whole blocks the scales are ``(rows, blocks_per_row)``, so they always
        shard with the parameter's rows (FSDP2, `mixprec.optim.sharding`);
        otherwise they are flat, ``(numel // block_size,)``. The shape depends
        on the parameter's shape only, never on how it is sharded. Either way
        scale ``b`` (in row-major order) belongs to elements
        ``[b * block_size, (b + 1) * block_size)``.
        """
        numel = 1
        for size in shape:
            numel *= size
        row = numel // shape[0] if len(shape) >= 2 and shape[0] else 0
        if len(shape) >= 2 and row % self.block_size == 0 and row > 0:
            return (shape[0], row // self.block_size)
        return (numel // self.block_size,)

    def init_state(self, param: torch.Tensor, slots: Slots) -> dict[str, torch.Tensor]:
        """Zero codes shaped like `param` and zero scales, one per block (`scale_shape`)."""
        import torch

        scales = self.scale_shape(param.shape)
        return {
            t.name: torch.zeros(scales, dtype=torch.float32, device=param.device)
            if t.per_block
            else torch.zeros_like(param, dtype=t.torch_dtype)
            for t in self.spec.state_for(slots)
        }

    def kernel_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """``(numel // block_size, block_size)``: one row per block."""
        return (math.prod(shape) // self.block_size, self.block_size)

    def decode(
        self, state: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Dequantized fp32 moments, shaped like the codes (codes and scale per moment)."""
        return tuple(
            (dequantize_signed if kind == "signed" else dequantize_sqrt)(
                state[2 * i], state[2 * i + 1]
            )
            for i, kind in enumerate(kinds)
        )

    def encode(
        self, moments: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Quantized codes and scales, moment after moment."""
        return tuple(
            t
            for m, kind in zip(moments, kinds, strict=True)
            for t in (quantize_signed if kind == "signed" else quantize_sqrt)(m)
        )


register_moments(SPEC, lambda block_size: Int8Moments(block_size=block_size))
