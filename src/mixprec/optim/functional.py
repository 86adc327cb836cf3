"""The AdamW update as pure functions in fp32, shared by every storage format.

`adamw_scalars` turns hyperparameters and the step count into the handful of
per-step scalars (computed in float64, like `torch.optim.AdamW`), and
`adamw_math` applies one step elementwise. Neither touches optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch

from mixprec.formats.rounding import sqrt_rn

__all__ = ["AdamWScalars", "adamw_math", "adamw_scalars"]


@dataclass(frozen=True, kw_only=True)
class AdamWScalars:
    """Per-step scalars of AdamW, in the order `adamw_math` reads them.

    Attributes:
        decay: ``1 - lr * weight_decay`` (decoupled weight decay).
        one_minus_beta1: weight of the gradient in the first moment.
        beta2: decay of the second moment.
        one_minus_beta2: weight of the squared gradient in the second moment.
        neg_step_size: ``-lr / (1 - beta1**step)``.
        inv_bias_correction2_sqrt: ``1 / sqrt(1 - beta2**step)``.
        eps: added to the denominator.
    """

    decay: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    neg_step_size: float
    inv_bias_correction2_sqrt: float
    eps: float

    def as_tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """The scalars as one fp32 vector (passed to the kernels as data, not constants)."""
        return torch.tensor(astuple(self), dtype=torch.float32, device=device)


def adamw_scalars(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> AdamWScalars:
    """The per-step scalars for step number ``step`` (1 for the first update)."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return AdamWScalars(
        decay=1.0 - lr * weight_decay,
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        neg_step_size=-lr / bias_correction1,
        inv_bias_correction2_sqrt=1.0 / math.sqrt(bias_correction2),
        eps=eps,
    )


def adamw_math(
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step in fp32, in the operation order of `torch.optim.AdamW`.

    Args:
        param: fp32 parameter values (the full-precision master).
        grad: fp32 gradients (already negated for ``maximize``).
        exp_avg: fp32 first moment.
        exp_avg_sq: fp32 second moment.
        scalars: fp32 vector from `AdamWScalars.as_tensor`.

    Returns:
        ``(param, exp_avg, exp_avg_sq)`` after the step, as new tensors.
    """
    decay, one_minus_beta1, beta2, one_minus_beta2 = scalars[0], scalars[1], scalars[2], scalars[3]
    neg_step_size, inv_bc2_sqrt, eps = scalars[4], scalars[5], scalars[6]
    param = param * decay
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    denom = sqrt_rn(exp_avg_sq) * inv_bc2_sqrt + eps
    param = param + (neg_step_size * exp_avg) / denom
    return param, exp_avg, exp_avg_sq
