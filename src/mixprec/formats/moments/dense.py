"""Moment formats ``fp32`` and ``bf16``: one dense tensor per moment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mixprec.formats.moments.base import Slots
from mixprec.formats.registry import register_moments
from mixprec.formats.spec import MomentSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = ["BF16_SPEC", "FP32_SPEC", "DenseMoments"]

#: The registry entry of ``fp32``.
FP32_SPEC = MomentSpec(
    name="fp32",
    summary="fp32 moments (torch's AdamW)",
    signed=(StateTensor("{}", "fp32"),),
    square=(StateTensor("{}", "fp32"),),
    rounds_increments=False,
    kernel_code=0,
)

#: The registry entry of ``bf16``.
BF16_SPEC = MomentSpec(
    name="bf16",
    summary="bf16 moments, rounded to nearest every step",
    signed=(StateTensor("{}", "bf16"),),
    square=(StateTensor("{}", "bf16"),),
    rounds_increments=True,
    kernel_code=1,
)


@dataclass(frozen=True)
class DenseMoments:
    """Each moment stored in the spec's dtype (round to nearest even).

    With bf16, increments below half an ulp of the stored value are lost: with
    ``beta2 = 0.999`` the second moment cannot decay (a step changes it by at
    most 0.1%, under bf16's 0.39% half-ulp), it only grows.
    """

    spec: MomentSpec

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of every moment."""
        dtype: torch.dtype = self.spec.signed[0].torch_dtype
        return dtype

    def init_state(self, param: torch.Tensor, slots: Slots) -> dict[str, torch.Tensor]:
        """Zero moments in `dtype`, shaped like `param`."""
        import torch  # (see moments/__init__: specs load without torch)

        return {key: torch.zeros_like(param, dtype=self.dtype) for key, _ in slots}

    def kernel_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Flat: ``(numel,)``."""
        return (math.prod(shape),)

    def decode(
        self, state: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The moments upcast to fp32."""
        import torch

        return tuple(t.to(torch.float32) for t in state)

    def encode(
        self, moments: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The moments rounded to `dtype`."""
        return tuple(m.to(self.dtype) for m in moments)


register_moments(FP32_SPEC, lambda block_size: DenseMoments(FP32_SPEC))
register_moments(BF16_SPEC, lambda block_size: DenseMoments(BF16_SPEC))
