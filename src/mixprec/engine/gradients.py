"""Small pure helpers over gradients and optimizers that the engine's modules share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "SIXTEEN_BIT",
    "any_across_ranks",
    "check_max_norm",
    "count_nonfinite",
    "grad_versions",
    "has_grads",
    "optimizer_params",
    "total_norm",
]

#: The 16-bit storage dtypes.
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of every group of `optimizer`, in group order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def has_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of `optimizer` holds a gradient."""
    return any(p.grad is not None for p in optimizer_params(optimizer))


def check_max_norm(max_norm: float) -> float:
    """`max_norm` as a float, refused unless a number > 0 (``inf`` only measures)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | torch.Tensor):
        raise TypeError(f"max_norm must be a number > 0 (e.g. 1.0), got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:  # also refuses NaN
        raise ValueError(
            f"max_norm must be > 0 (e.g. 1.0; float('inf') only measures the norm), got "
            f"{value!r}: 0 zeroes every gradient and a negative value trains by gradient ascent"
        )
    return value


def count_nonfinite(grads: Sequence[torch.Tensor]) -> int:
    """How many elements of `grads` are inf or NaN (one host sync)."""
    return int(sum(int((~torch.isfinite(g)).sum()) for g in grads))


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of `grads`, one fused reduction (inf/NaN kept, never raised)."""
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)


def any_across_ranks(flag: bool, device: torch.device) -> bool:
    """True if `flag` is true on any rank (every rank then skips together)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def grad_versions(optimizers: Iterable[torch.optim.Optimizer]) -> dict[int, tuple[int, int]]:
    """Each gradient's identity and in-place version counter, by parameter id."""
    return {
        id(p): (id(p.grad), p.grad._version)
        for opt in optimizers
        for p in optimizer_params(opt)
        if p.grad is not None
    }
