"""Master format ``none``: the stored parameter is the master, updated in place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec

if TYPE_CHECKING:
    import torch

__all__ = ["SPEC", "NoMaster"]


#: The registry entry of ``none``.
SPEC = MasterSpec(
    name="none",
    summary="the parameter is its own master: 16-bit updates are rounded to nearest",
    state=(),
    param_dtypes=None,
    exact=False,
    keeps_small_updates=False,
    uses_noise=False,
    kernel_code=0,
)


@dataclass(frozen=True)
class NoMaster:
    """Update the parameter in its own dtype (round to nearest even for 16-bit)."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """No state."""
        return {}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameter upcast to fp32."""
        import torch  # (see masters/__init__: specs load without torch)

        return param.to(torch.float32)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The value rounded to the parameter dtype."""
        return value.to(dtype), ()


register_master(NoMaster())
