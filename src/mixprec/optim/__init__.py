"""Optimizers with explicit master-weight and moment storage formats."""

from mixprec.optim.adamw import AdamW
from mixprec.optim.kinds import MASTER_KINDS, MOMENT_KINDS, MasterKind, MomentKind

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "AdamW",
    "MasterKind",
    "MomentKind",
]
