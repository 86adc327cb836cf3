"""Master format ``fp32``: a separate fp32 copy of each 16-bit parameter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.optim.kinds import MasterKind
from mixprec.optim.masters._checks import require_dtype

__all__ = ["Fp32Master"]


@dataclass(frozen=True)
class Fp32Master:
    """An fp32 copy (state ``master``); the parameter is its nearest-even rounding."""

    kind: MasterKind = "fp32"
    state_keys: tuple[str, ...] = ("master",)
    uses_noise: bool = False

    def check_dtype(self, dtype: torch.dtype) -> None:
        """bf16 or fp16 params only: an fp32 copy of fp32 params doubles memory for nothing."""
        require_dtype(self.kind, dtype, (torch.bfloat16, torch.float16))

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter upcast to fp32."""
        master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        master.copy_(param.detach())
        return {"master": master}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The stored fp32 copy."""
        return state[0]

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The value itself, and its rounding as the parameter."""
        return value.to(dtype), (value,)
