"""Flat views of parameters and their state in memory order (channels-last too).

The step is elementwise, so it may walk a parameter in any order as long as the
gradient and every state tensor are walked in the same one. A dense parameter
(contiguous, or a permutation of contiguous such as channels-last) is viewed as
one flat run of memory; its gradient and its state are made with the same
strides (`torch.zeros_like` keeps them), so the same view lines them up.
"""

from __future__ import annotations

import torch

__all__ = ["flat_view", "is_dense", "like_param"]


def _memory_order(t: torch.Tensor) -> list[int]:
    strides, sizes = list(t.stride()), list(t.shape)
    return sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d]))


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t` covers one run of memory with no gaps or overlaps (any dim order)."""
    return t.is_contiguous() or t.permute(_memory_order(t)).is_contiguous()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of dense `t` in memory order (raises for a tensor that is not dense)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.permute(_memory_order(t)).view(-1)


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` with `param`'s strides (a copy only when they differ)."""
    if grad.stride() == param.stride():
        return grad
    out = torch.empty_like(param, dtype=grad.dtype)
    out.copy_(grad)
    return out
