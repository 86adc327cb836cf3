"""Optimizers with explicit master-weight and moment storage formats."""

from mixprec.formats import MASTER_KINDS, MOMENT_KINDS
from mixprec.optim.adam import Adam
from mixprec.optim.adamw import AdamW
from mixprec.optim.lion import Lion
from mixprec.optim.mastered import Mastered
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.sgd import SGD

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "SGD",
    "Adam",
    "AdamW",
    "Lion",
    "Mastered",
    "RuleOptimizer",
]
