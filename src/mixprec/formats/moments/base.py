"""The interface every moment storage format implements.

`decode` gives fp32 views of the AdamW moments from the stored state and
`encode` stores new fp32 moments; both are pure and work on parameter-shaped
tensors viewed as `kernel_shape` (per-block tensors such as scales stay 1-D).
What the format stores is declared once in its `spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from mixprec.formats.spec import MomentSpec

if TYPE_CHECKING:
    import torch

__all__ = ["MomentFormat"]


class MomentFormat(Protocol):
    """How the first and second AdamW moments of one parameter are stored."""

    @property
    def spec(self) -> MomentSpec:
        """What the format stores (its registry entry)."""
        ...

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero moments for `param` (element tensors shaped like it)."""
        ...

    def kernel_shape(self, numel: int) -> tuple[int, ...]:
        """The shape the step views parameter-shaped tensors as (flat or blocks)."""
        ...

    def decode(self, state: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(exp_avg, exp_avg_sq)`` shaped like `kernel_shape`."""
        ...

    def encode(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New state tensors (flat) in `state_keys` order."""
        ...
