"""The update rule a named optimizer steps with: what decides the moments a budget counts.

``estimate(model, policy, optimizer="sgd", optimizer_args={"momentum": 0.9})`` and
``mixprec budget --optimizer sgd --optimizer-args momentum=0.9`` name one of
`mixprec.optim`'s optimizers by its short name. Its arguments pick its rule
(``sgd_momentum``: one moment, ``momentum_buffer``), and the rule's slots
(`mixprec.optim.rules.Rule.slots`) are the moments counted, each in the policy's
moment format. The rule is the one the optimizer itself picks: a throwaway instance
over one element is asked, so its own checks refuse bad arguments as training would.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.optim import OPTIMIZERS

__all__ = ["OPTIMIZER_NAMES", "optimizer_rule"]

#: Short names of `mixprec.optim`'s optimizers, as ``--optimizer`` takes them.
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)

#: Arguments a budget takes from the policy or its own defaults, not the optimizer's.
_FROM_POLICY = ("master", "moments", "block_size", "min_int8_numel")


def optimizer_rule(name: str, args: Mapping[str, Any] | None = None) -> str:
    """The name of the rule (`mixprec.optim.rules.RULES`) `mixprec.optim`'s optimizer
    `name` steps with under keyword arguments `args`.

    Raises:
        ValueError: an unknown name, an argument the optimizer does not take or
            refuses (its own message), or ``master``/``moments`` (the policy's).
    """
    cls: type[Any] | None = OPTIMIZERS.get(name.strip().lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZER_NAMES)}")
    kwargs = dict(args or {})
    taken = [key for key in _FROM_POLICY if key in kwargs]
    if taken:
        raise ValueError(
            f"optimizer argument {taken[0]!r}: the policy decides the master and moment "
            "formats (--policy, or Policy.master/moments); drop it from the arguments"
        )
    probe = torch.zeros(1, requires_grad=True)
    try:
        opt = cls([probe], **kwargs)
    except TypeError as exc:  # an argument the optimizer does not take, or a bad type
        takes = set(inspect.signature(cls).parameters) - {"params", *_FROM_POLICY, "seed"}
        unknown = sorted(set(kwargs) - takes)
        if not unknown:
            raise ValueError(f"optimizer {name!r}: {exc}") from None
        raise ValueError(
            f"optimizer {name!r} takes no argument {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(takes))}"
        ) from None
    # The optimizer's own choice of rule for its group (one home: RuleOptimizer.rule_of).
    rule: str = opt.rule_of(opt.param_groups[0]).name
    return rule
