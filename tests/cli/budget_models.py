"""Models `mixprec budget --model` builds in tests/cli/test_budget.py."""

from __future__ import annotations

from torch import nn

__all__ = ["four_linears", "with_buffers"]


def four_linears() -> nn.Module:
    """Four linears of widths divisible by 16: the middle two convert under fp8."""
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128),
        nn.GELU(), nn.Linear(128, 10),
    )  # fmt: skip


def with_buffers() -> nn.Module:
    """`four_linears` after a BatchNorm, whose running statistics are buffers."""
    return nn.Sequential(nn.BatchNorm1d(64), four_linears())
