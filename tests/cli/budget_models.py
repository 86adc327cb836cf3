"""Models `mixprec budget --model` builds in tests/cli/test_budget.py."""

from __future__ import annotations

from torch import nn

__all__ = ["four_linears"]


def four_linears() -> nn.Module:
    """Four linears of widths divisible by 16: the middle two convert under fp8."""
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128),
        nn.GELU(), nn.Linear(128, 10),
    )  # fmt: skip
