"""Optimizers with explicit master-weight and moment storage formats."""

from mixprec.formats import MASTER_KINDS, MOMENT_KINDS
from mixprec.optim.adam import Adam
from mixprec.optim.adamw import AdamW
from mixprec.optim.lion import Lion
from mixprec.optim.mastered import Mastered
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.sgd import SGD

#: mixprec's optimizers by the short name ``compare``, ``train`` and ``budget`` take
#: (``--optimizer sgd``).
OPTIMIZERS: dict[str, type[RuleOptimizer]] = {
    "adamw": AdamW,
    "adam": Adam,
    "sgd": SGD,
    "lion": Lion,
}

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "AdamW",
    "Lion",
    "Mastered",
    "RuleOptimizer",
]
