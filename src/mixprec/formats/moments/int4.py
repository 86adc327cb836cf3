"""Moment format ``int4``: 4-bit codes, two per byte (Li, Chen, Zhu, NeurIPS 2023).

A parameter of shape ``(rows, ...)`` is viewed as the matrix
``(rows, cols = numel // rows)`` (`Int4Moments.kernel_shape`). Only parameters with
at least two dims and ``cols`` a multiple of `BLOCK_SIZE` use it (`Int4Moments.fits`;
the optimizer keeps fp32 moments for the others and for tensors under its
``min_int8_numel``, 4096 by default: the paper's threshold). Every state tensor is
laid out by rows, so each splits with dim 0 like the parameter (FSDP2's ``Shard(0)``)
except the column maxima: codes are packed two per byte along the matrix's rows,
element ``2k`` of a row in the low nibble and ``2k + 1`` in the high one (shape
``(rows, cols // 2)``).

* Signed moments (``exp_avg``): blocks of `BLOCK_SIZE` consecutive elements of one
  row (a block never straddles two rows), one fp32 absmax per block (shape
  ``(rows, cols // BLOCK_SIZE)``), and a square-root companded code
  ``q = round(7 * sqrt(|m| / absmax))`` in ``-7..7`` with m's sign (a 4-bit
  two's complement nibble; ``-8`` is never written). Decoding gives
  ``absmax * sign(q) * (q / 7)**2``: the int8 format's companding with 15 levels.
* Square moments (``exp_avg_sq``): rank-1 normalization. With ``r_i`` the
  maximum of row i and ``c_j`` that of column j (fp32, stored: shapes ``(rows,)``
  and ``(cols,)``), each element is divided by ``min(r_i, c_j)`` and stored with
  the zero-free linear code ``v = (q + 1) / 16 * min(r_i, c_j)``, ``q`` in
  ``0..15`` (nearest level). A nonzero v never decodes to 0 (which would turn
  ``m / (sqrt(v) + eps)`` into a huge step); v is stored at most `V_MAX` so an
  overflowing v cannot poison its row and column, and ``|m|`` at most `M_MAX`
  (its root), so ``|m| / sqrt(v)`` stays at most 1 where v is capped.

The column statistics span every row. For a parameter sharded by rows over several
ranks (FSDP2), every rank holds them whole (a replicated DTensor) and the step takes
each rank's column maxima to the maximum over ranks (`quantize_rank1`'s
`reduce_columns`: one all-reduce per matrix and step), so what is stored does not
depend on the sharding and a checkpoint reshards to any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.moments.base import Slots
from mixprec.formats.registry import register_moments
from mixprec.formats.spec import MomentSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK_SIZE",
    "M_MAX",
    "SPEC",
    "V_MAX",
    "Int4Moments",
    "dequantize_rank1",
    "dequantize_signed4",
    "pack",
    "quantize_rank1",
    "quantize_signed4",
    "unpack",
]

#: Takes one rank's column maxima to those of every rank's rows (FSDP2 shards).
ColumnReduce = Callable[["torch.Tensor"], "torch.Tensor"]

#: Elements per block of the signed moment's absmax (the paper's B128).
BLOCK_SIZE = 128

#: The registry entry of ``int4``.
SPEC = MomentSpec(
    name="int4",
    summary="4-bit codes, two per byte: blockwise signed, rank-1 normalized zero-free squares",
    signed=(
        StateTensor("{}_i4", "uint8", packed=True),
        StateTensor("{}_absmax", "fp32", per_block=True),
    ),
    square=(
        StateTensor("{}_u4", "uint8", packed=True),
        StateTensor("{}_rowmax", "fp32", per_row=True),
        StateTensor("{}_colmax", "fp32", per_column=True),
    ),
    rounds_increments=False,
    blockwise=True,
    block_size=BLOCK_SIZE,
    kernel_code=3,
)

#: Largest v stored: a finite bound whose decoded levels ``(q + 1) / 16 * V_MAX`` stay
#: finite, so a v that overflowed to inf cannot make its row's and column's maxima inf
#: (every other element would then decode to inf or NaN). Finite moments never reach it.
V_MAX = 2.0**126

#: Largest |m| stored: sqrt(V_MAX), so ``|m| / sqrt(v)`` stays at most 1 where v is
#: capped (as int8's M_MAX: a capped v with an uncapped m made a step of about 1e12).
M_MAX = 2.0**63


def _safe(x: torch.Tensor) -> torch.Tensor:
    import torch  # (see moments/__init__: specs load without torch)

    return torch.where(x > 0, x, torch.ones_like(x))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in ``0..15``, last dim even, to bytes holding two codes each (element
    ``2k`` in the low nibble): shape ``(*codes.shape[:-1], codes.shape[-1] // 2)``."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: the codes, last dim doubled."""
    import torch

    both = torch.stack((packed & 15, packed >> 4), dim=-1)
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_signed4(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 moments, a matrix ``(rows, cols)`` with cols a multiple of `BLOCK_SIZE`, to
    (packed codes ``(rows, cols // 2)``, fp32 absmax per block ``(rows, cols //
    BLOCK_SIZE)``); ``|m|`` is stored at most `M_MAX`."""
    import torch

    from mixprec.formats.rounding import sqrt_rn

    xb = m.reshape(-1, BLOCK_SIZE).clamp(-M_MAX, M_MAX)  # NaN stays NaN
    absmax = xb.abs().amax(dim=1).reshape(*m.shape[:-1], m.shape[-1] // BLOCK_SIZE)
    # reciprocal-then-multiply, as in the int8 format (see its comment)
    factor = torch.reciprocal(_safe(absmax)) * 49.0
    q = torch.round(sqrt_rn(xb.abs() * factor.reshape(-1, 1)))
    nibble = torch.where(xb < 0, 16.0 - q, q)  # two's complement; -0 stays 0 below
    nibble = torch.where(nibble == 16.0, 0.0, nibble)
    return pack(nibble.to(torch.uint8).reshape(m.shape)), absmax


def dequantize_signed4(packed: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_signed4` (up to the quantization error), shaped like the codes
    unpacked (block ``b`` of the absmax, in row-major order, scales elements
    ``[b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)``)."""
    import torch

    nibble = unpack(packed).to(torch.float32)
    q = torch.where(nibble >= 8.0, nibble - 16.0, nibble)
    qb = q.reshape(-1, BLOCK_SIZE)
    out = (qb * qb.abs()) * (absmax * (1.0 / 49.0)).reshape(-1, 1)
    return out.reshape(q.shape)


def quantize_rank1(
    v: torch.Tensor, reduce_columns: ColumnReduce | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-negative fp32 matrix ``(rows, cols)``, cols even, to (packed codes, fp32 row
    maxima, fp32 column maxima). `reduce_columns`: for a matrix that is one rank's rows
    of a larger one (an FSDP2 shard), takes this rank's column maxima to those of every
    row (an all-reduce of the maximum), so each rank stores what one process would."""
    import torch

    v = torch.where(v > V_MAX, V_MAX, v)  # NaN stays NaN
    rowmax = v.amax(dim=1)
    colmax = v.amax(dim=0) if v.shape[0] else v.new_zeros(v.shape[1])  # (a rank holding no rows)
    if reduce_columns is not None:
        colmax = reduce_columns(colmax)
    # 1 / min(r, c) == max(1 / r, 1 / c) exactly (the reciprocal is monotone and
    # correctly rounded); scaled by 16, a power of two.
    row_f = torch.reciprocal(_safe(rowmax)) * 16.0
    col_f = torch.reciprocal(_safe(colmax)) * 16.0
    t = v * torch.maximum(row_f[:, None], col_f[None, :])
    q = torch.clamp(torch.round(t) - 1.0, 0.0, 15.0)
    return pack(q.to(torch.uint8)), rowmax, colmax


def dequantize_rank1(
    packed: torch.Tensor, rowmax: torch.Tensor, colmax: torch.Tensor
) -> torch.Tensor:
    """Inverse of `quantize_rank1` (up to the quantization error), shaped like the codes
    unpacked (any shape of ``rows * cols`` elements in row-major order)."""
    import torch

    q = unpack(packed).to(torch.float32)
    scale = torch.minimum(rowmax[:, None], colmax[None, :])
    levels = (q.reshape(scale.shape) + 1.0) * 0.0625
    return (levels * scale).reshape(q.shape)


@dataclass(frozen=True)
class Int4Moments:
    """4-bit moments (see module docs). Blocks are always `BLOCK_SIZE` elements."""

    spec: ClassVar[MomentSpec] = SPEC
    block_size: int = BLOCK_SIZE

    @staticmethod
    def fits(shape: Sequence[int]) -> bool:
        """Whether a parameter of `shape` can keep int4 moments: at least two dims, and
        every row of its matrix view ``(shape[0], numel // shape[0])`` whole blocks of
        `BLOCK_SIZE` (the minimum size is the optimizer's ``min_int8_numel``)."""
        if len(shape) < 2 or shape[0] <= 0:
            return False
        cols = math.prod(shape) // shape[0]
        return cols > 0 and cols % BLOCK_SIZE == 0

    def init_state(self, param: torch.Tensor, slots: Slots) -> dict[str, torch.Tensor]:
        """Zero packed codes ``(rows, cols // 2)``, zero absmax per block ``(rows, cols //
        BLOCK_SIZE)``, zero row maxima ``(rows,)`` and column maxima ``(cols,)``."""
        import torch

        rows, cols = self.kernel_shape(param.shape)
        state = {}
        for t in self.spec.state_for(slots):
            size = (
                (rows, cols // BLOCK_SIZE)
                if t.per_block
                else (rows,)
                if t.per_row
                else (cols,)
                if t.per_column
                else (rows, cols // 2)
            )
            state[t.name] = torch.zeros(size, dtype=t.torch_dtype, device=param.device)
        return state

    def kernel_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The matrix view ``(shape[0], numel // shape[0])`` (a shard of no rows keeps
        its columns)."""
        if len(shape) < 2:
            return (1, math.prod(shape))
        return (shape[0], math.prod(shape[1:]))

    def decode(
        self, state: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Dequantized fp32 moments, shaped like the codes unpacked."""
        out = []
        i = 0
        for kind in kinds:
            if kind == "signed":
                out.append(dequantize_signed4(state[i], state[i + 1]))
                i += 2
            else:
                out.append(dequantize_rank1(state[i], state[i + 1], state[i + 2]))
                i += 3
        return tuple(out)

    def encode(
        self,
        moments: Sequence[torch.Tensor],
        kinds: tuple[str, ...],
        reduce_columns: ColumnReduce | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Packed codes ``(rows, cols // 2)`` and statistics (1-D, as every format's
        scales: the absmax in row-major block order), moment after moment (each moment a
        matrix ``(rows, cols)``; `reduce_columns`: see `quantize_rank1`)."""
        out: list[torch.Tensor] = []
        for m, kind in zip(moments, kinds, strict=True):
            if kind == "signed":
                packed, absmax = quantize_signed4(m)
                out += (packed, absmax.reshape(-1))
            else:
                out += quantize_rank1(m, reduce_columns)
        return tuple(out)


register_moments(SPEC, lambda block_size: Int4Moments())
