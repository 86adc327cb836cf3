"""Master format ``remainder8``: bf16 parameter + int8 correction (a 24-bit master).

Each new fp32 value is first rounded (nearest even) to 15 explicit mantissa
bits, a 24-bit float with fp32's exponent range; that value is then split
exactly into a nearest bf16 (ties away from zero) and a signed 8-bit remainder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = ["MANTISSA_BITS_24", "SPEC", "Remainder8Master"]


#: The registry entry of ``remainder8``.
SPEC = MasterSpec(
    name="remainder8",
    summary="bf16 + int8 remainder: a 24-bit master",
    state=(StateTensor("remainder", "int8"),),
    param_dtypes=("bf16",),
    exact=False,
    keeps_small_updates=True,
    uses_noise=False,
    kernel_code=3,
)

#: Explicit mantissa bits of the 24-bit master (bf16's 7 plus 8).
MANTISSA_BITS_24 = 15


@dataclass(frozen=True)
class Remainder8Master:
    """bf16 + int8 remainder (state ``remainder``): fp32 master to 24 bits."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero remainder: the master starts equal to the bf16 parameter."""
        import torch  # (see masters/__init__: specs load without torch)

        return {"remainder": torch.zeros_like(param, dtype=torch.int8)}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The 24-bit master as fp32 (low 8 bits zero)."""
        from mixprec.formats.bits import merge_float

        return merge_float(param, state[0], low_bits=8)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Round to 24 bits, then split into bf16 + int8."""
        import torch

        from mixprec.formats.bits import round_to_bits, split_float

        value24 = round_to_bits(value, mantissa_bits=MANTISSA_BITS_24)
        high, low = split_float(value24, dtype=dtype, low_bits=8)
        return high, (low.to(torch.int8),)


register_master(Remainder8Master())
