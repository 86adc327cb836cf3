"""Optimizers with explicit master-weight and moment storage formats."""

from mixprec.formats import MASTER_KINDS, MOMENT_KINDS
from mixprec.optim.accounting import optimizer_state_bytes, training_state_bytes
from mixprec.optim.adamw import AdamW

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "AdamW",
    "optimizer_state_bytes",
    "training_state_bytes",
]
