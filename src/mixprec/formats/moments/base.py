"""The interface every moment storage format implements.

`decode` gives fp32 moments from the stored state and `encode` stores new fp32
moments, for the moments an update rule keeps (`slots`: ``(key, kind)`` pairs,
`mixprec.optim.rules`); both are pure and work on parameter-shaped tensors viewed
as `kernel_shape` (per-block, per-row and per-column tensors such as scales stay
1-D; packed 4-bit codes keep the leading dim and half the last). What the format
stores for each kind of moment is declared once in its `spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from mixprec.formats.spec import MomentSpec

if TYPE_CHECKING:
    import torch

__all__ = ["MomentFormat", "Slots"]

#: The moments an update rule keeps: ``(state key, kind)`` pairs.
Slots = tuple[tuple[str, str], ...]


class MomentFormat(Protocol):
    """How the first and second AdamW moments of one parameter are stored."""

    @property
    def spec(self) -> MomentSpec:
        """What the format stores (its registry entry)."""
        ...

    def init_state(self, param: torch.Tensor, slots: Slots) -> dict[str, torch.Tensor]:
        """Zero moments `slots` for `param` (element tensors shaped like it)."""
        ...

    def kernel_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape the step views a parameter of `shape` as (flat, blocks or a matrix)."""
        ...

    def decode(
        self, state: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """One fp32 moment per kind (``signed``/``square``), shaped like `kernel_shape`,
        from the state tensors `spec.state_for` lists."""
        ...

    def encode(
        self, moments: Sequence[torch.Tensor], kinds: tuple[str, ...]
    ) -> tuple[torch.Tensor, ...]:
        """New state tensors (flat), in `spec.state_for` order."""
        ...
