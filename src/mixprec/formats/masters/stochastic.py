"""Master format ``stochastic``: bf16 parameter updated with stochastic rounding.

A new fp32 value between two neighbouring bf16 values rounds to the farther one
with probability (distance to the nearer) / (gap), drawn with 16 random bits
(exact for fp32 inputs), so the rounded value equals the fp32 value in
expectation. The random bits come from `mixprec.optim.rng` (a hash of seed,
step and element index), so results are reproducible and survive a save and
reload. No extra memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mixprec.formats.registry import register_master
from mixprec.formats.spec import MasterSpec

if TYPE_CHECKING:
    import torch

__all__ = ["SPEC", "StochasticMaster", "stochastic_round"]


#: The registry entry of ``stochastic``.
SPEC = MasterSpec(
    name="stochastic",
    summary="bf16 rounded stochastically: the master in expectation, no state",
    state=(),
    param_dtypes=("bf16",),
    exact=False,
    keeps_small_updates=True,
    uses_noise=True,
    kernel_code=5,
)


def stochastic_round(
    value: torch.Tensor, noise: torch.Tensor, *, dtype: torch.dtype
) -> torch.Tensor:
    """Round fp32 `value` to `dtype` (bf16) stochastically with 16-bit integer `noise`.

    Adds the noise to the low 16 bits of the bit pattern and truncates them
    (the magnitude rounds away from zero exactly when the carry happens, with
    probability (low 16 bits) / 65536): the rule of torchao's bf16
    stochastic rounding (``torchao.optim.quant_utils._fp32_to_bf16_sr``).

    Args:
        value: fp32 values.
        noise: integers uniform in ``[0, 65536)``, one per value.
        dtype: bf16.

    Returns:
        Values in `dtype`, unbiased for every finite input (a finite value
        above the largest bf16 rounds to it or to inf, inf standing for 2**128).
        Infinities stay; NaN becomes the canonical NaN.
    """
    import torch  # (see masters/__init__: specs load without torch)

    from mixprec.formats.bits import canonical_bits

    assert dtype == torch.bfloat16
    rounded = (canonical_bits(value) + noise.to(torch.int32)) & -65536
    return rounded.view(torch.float32).to(dtype)


@dataclass(frozen=True)
class StochasticMaster:
    """bf16 param rounded stochastically; the master exists only in expectation."""

    spec: ClassVar[MasterSpec] = SPEC

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """No state (the seed is kept by the optimizer as ``rng_seed``)."""
        return {}

    def decode(self, param: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameter upcast to fp32."""
        import torch

        return param.to(torch.float32)

    def encode(
        self, value: torch.Tensor, *, dtype: torch.dtype, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Stochastically rounded parameter."""
        assert noise is not None
        return stochastic_round(value, noise, dtype=dtype), ()


register_master(StochasticMaster())
