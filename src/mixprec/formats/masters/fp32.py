"""Master format ``fp32``: a separate fp32 copy of each 16-bit parameter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = ["SPEC", "Fp32Master"]


#: The registry entry of ``fp32``.
SPEC = MasterSpec(
    name="fp32",
    summary="a separate fp32 copy of the 16-bit parameter",
    state=(StateTensor("master", "fp32"),),
    param_dtypes=("bf16", "fp16"),
    exact=True,
    keeps_small_updates=True,
    uses_noise=False,
    kernel_code=1,
)


@dataclass(frozen=True)
class Fp32Master:
    """An fp32 copy (state ``master``); the parameter is its nearest-even rounding."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter upcast to fp32."""
        import torch  # (see masters/__init__: specs load without torch)

        master = torch.empty_like(param, dtype=torch.float32)
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


register_master(Fp32Master())
