"""The interface every master-weight format implements.

A master format says how the full-precision value of a parameter is kept:
`decode` gives the fp32 value from the stored parameter and its state, and
`encode` turns a new fp32 value into the new stored parameter and state. Both
are pure and elementwise, so they compose into one fused step. What the format
stores and needs is declared once in its `spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from mixprec.formats.spec import MasterSpec

if TYPE_CHECKING:
    import torch

__all__ = ["MasterFormat"]


class MasterFormat(Protocol):
    """How one parameter's full-precision value is stored (see module docs)."""

    spec: ClassVar[MasterSpec]

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state for `param`, shaped like it (so it shards with it on dim 0)."""
        ...

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fp32 master value."""
        ...

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """New stored parameter (in `dtype`) and state from the new fp32 value."""
        ...
