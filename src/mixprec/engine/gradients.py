"""Small pure helpers over gradients and optimizers that the engine's modules share."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mixprec.optim.sharding import is_dtensor

__all__ = [
    "SIXTEEN_BIT",
    "agree_across_ranks",
    "any_across_ranks",
    "count_nonfinite",
    "optimizer_params",
    "plain",
    "total_norm",
]

#: The 16-bit storage dtypes.
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of every group of `optimizer`, in group order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def count_nonfinite(grads: Sequence[torch.Tensor]) -> int:
    """How many elements of `grads` are inf or NaN (one host sync per gradient; over a
    sharded gradient, the global count)."""
    return int(sum(int(plain((~torch.isfinite(g)).sum())) for g in grads))


def plain(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor: a `DTensor` (a norm over FSDP2's sharded gradients) is
    made whole, a collective every rank takes part in."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of `grads`, one fused reduction (inf/NaN kept, never raised);
    over sharded (`DTensor`) gradients, the global norm, on every rank."""
    if not grads:
        return torch.zeros(())
    return plain(torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False))


def any_across_ranks(flag: bool, device: torch.device) -> bool:
    """True if `flag` is true on any rank (every rank then skips together)."""
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agree_across_ranks(norm: float, nonfinite: int, device: torch.device) -> tuple[float, int]:
    """The step's gradient norm and non-finite count as every rank reports them: the
    largest over ranks, in one collective (inf and NaN norms kept, NaN first).

    Under DDP and FSDP2 the gradients every rank reads are the same or global
    already, so this changes nothing unless a rank's gradients were edited after
    the reduction (a rank-local hook, an inf that appeared there): then every rank
    still decides, and reports, the same.
    """
    if not _distributed():
        return norm, nonfinite
    nan, inf = math.isnan(norm), math.isinf(norm)
    finite = 0.0 if (nan or inf) else norm
    t = torch.tensor(
        [float(nonfinite), finite, float(inf), float(nan)], dtype=torch.float64, device=device
    )
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    count, finite, any_inf, any_nan = t.tolist()
    agreed = math.nan if any_nan else math.inf if any_inf else finite
    return agreed, int(count)
