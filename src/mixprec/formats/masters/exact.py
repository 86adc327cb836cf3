"""Master format ``exact``: bf16 parameter + 16-bit remainder, bitwise fp32.

The fp32 master's bit pattern is split into its upper 16 bits rounded to
nearest with ties away from zero (the bf16 parameter) and the signed 16-bit
difference (the remainder), see `mixprec.formats.bits`. The remainder is kept as
two int8 planes, ``remainder_hi`` (the signed high byte) and ``remainder_lo``
(the low byte's bits, read back with ``& 0xFF``), not one int16 tensor:
collectives have no int16 type (NCCL's types stop at int8/int32; gloo raises
"Invalid scalar type"), so an int16 state could not be gathered into a full
state dict of a sharded run, and Inductor's C++ backend does not vectorize
int16 at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = ["SPEC", "ExactMaster", "join_remainder16", "split_remainder16"]


#: The registry entry of ``exact``.
SPEC = MasterSpec(
    name="exact",
    summary="bf16 + 16-bit remainder: the fp32 master bit for bit",
    state=(
        StateTensor("remainder_hi", "int8"),
        StateTensor("remainder_lo", "int8"),
    ),
    param_dtypes=("bf16",),
    exact=True,
    keeps_small_updates=True,
    uses_noise=False,
    kernel_code=2,
)


def split_remainder16(low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 remainders in ``[-32768, 32768)`` to (signed high byte, low byte), both int8."""
    import torch  # (see masters/__init__: specs load without torch)

    low_byte = ((low & 0xFF) ^ 0x80) - 0x80  # the low byte's bits as a signed value
    return (low >> 8).to(torch.int8), low_byte.to(torch.int8)


def join_remainder16(rem_hi: torch.Tensor, rem_lo: torch.Tensor) -> torch.Tensor:
    """The int32 remainder from its two int8 byte planes."""
    import torch

    return rem_hi.to(torch.int32) * 256 + (rem_lo.to(torch.int32) & 0xFF)


@dataclass(frozen=True)
class ExactMaster:
    """bf16 + 16-bit remainder reconstructing the fp32 master bit for bit."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero remainders: the master starts equal to the bf16 parameter."""
        import torch

        return {
            "remainder_hi": torch.zeros_like(param, dtype=torch.int8),
            "remainder_lo": torch.zeros_like(param, dtype=torch.int8),
        }

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fp32 master, bitwise."""
        from mixprec.formats.bits import merge_float

        return merge_float(param, join_remainder16(state[0], state[1]), low_bits=16)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Nearest bf16 (ties away from zero) and the exact remainder."""
        from mixprec.formats.bits import split_float

        high, low = split_float(value, dtype=dtype, low_bits=16)
        return high, split_remainder16(low)


register_master(ExactMaster())
