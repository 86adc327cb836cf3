"""Optimizers with explicit master-weight and moment storage formats."""

from mixprec.formats import MASTER_KINDS, MOMENT_KINDS
from mixprec.optim.adamw import AdamW

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "AdamW",
]
