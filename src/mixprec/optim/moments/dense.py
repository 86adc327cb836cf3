"""Moment formats ``fp32`` and ``bf16``: one dense tensor per moment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.optim.kinds import MomentKind

__all__ = ["DenseMoments"]


@dataclass(frozen=True)
class DenseMoments:
    """``exp_avg`` and ``exp_avg_sq`` stored in `dtype` (round to nearest even).

    With bf16, increments below half an ulp of the stored value are lost: with
    ``beta2 = 0.999`` the second moment cannot decay (a step changes it by at
    most 0.1%, under bf16's 0.39% half-ulp), it only grows.
    """

    kind: MomentKind
    dtype: torch.dtype
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero moments in `dtype`, shaped like `param`."""
        return {
            key: torch.zeros(param.shape, dtype=self.dtype, device=param.device)
            for key in self.state_keys
        }

    def kernel_shape(self, numel: int) -> tuple[int, ...]:
        """Flat: ``(numel,)``."""
        return (numel,)

    def decode(self, state: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments upcast to fp32."""
        return state[0].to(torch.float32), state[1].to(torch.float32)

    def encode(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The moments rounded to `dtype`."""
        return exp_avg.to(self.dtype), exp_avg_sq.to(self.dtype)
