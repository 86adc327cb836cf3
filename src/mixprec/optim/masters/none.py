"""Master format ``none``: the stored parameter is the master, updated in place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.optim.kinds import MasterKind

__all__ = ["NoMaster"]


@dataclass(frozen=True)
class NoMaster:
    """Update the parameter in its own dtype (round to nearest even for 16-bit)."""

    kind: MasterKind = "none"
    state_keys: tuple[str, ...] = ()
    uses_noise: bool = False

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Any floating dtype is accepted."""
        if not dtype.is_floating_point:
            raise ValueError(f"master='none' needs floating params, got {dtype}")

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """No state."""
        return {}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameter upcast to fp32."""
        return param.to(torch.float32)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The value rounded to the parameter dtype."""
        return value.to(dtype), ()
