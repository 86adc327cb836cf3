"""Master format ``kahan``: 16-bit parameter + 16-bit compensation (Kahan summation).

The master is ``param + compensation``. After an update the parameter is the
nearest 16-bit value of the new master and the compensation keeps what that
rounding lost (itself rounded to 16 bits), so small updates accumulate in the
compensation until they move the parameter: Kahan's compensated summation
with the error term stored in the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec, StateTensor

if TYPE_CHECKING:
    import torch

__all__ = ["SPEC", "KahanMaster"]


#: The registry entry of ``kahan``.
SPEC = MasterSpec(
    name="kahan",
    summary="16-bit parameter + 16-bit Kahan compensation",
    # Stored in the parameter's own dtype (bf16 or fp16: two bytes either way).
    state=(StateTensor("compensation", "bf16", follows_param=True),),
    param_dtypes=("bf16", "fp16"),
    exact=False,
    keeps_small_updates=True,
    uses_noise=False,
    kernel_code=4,
)


@dataclass(frozen=True)
class KahanMaster:
    """16-bit param + 16-bit compensation buffer (state ``compensation``)."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero compensation."""
        import torch  # (see masters/__init__: specs load without torch)

        return {"compensation": torch.zeros_like(param)}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """``param + compensation`` in fp32."""
        import torch

        return param.to(torch.float32) + state[0].to(torch.float32)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Nearest 16-bit value and the (16-bit) rounding error."""
        import torch

        param = value.to(dtype)
        return param, ((value - param.to(torch.float32)).to(dtype),)


register_master(KahanMaster())
