"""`Lion` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") over chosen formats.

Per element, with ``g`` the gradient and ``m`` the one moment::

    update = sign(beta1 * m + (1 - beta1) * g)
    param  = param * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

The update's size is ``lr`` everywhere, so Lion takes a learning rate 3-10x
smaller than AdamW's and a weight decay as much larger (the paper's advice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.formats.registry import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim.options import check_lion, refuse_unsupported
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.rules import RULES, Rule

__all__ = ["Lion"]


class Lion(RuleOptimizer):
    """Lion with a chosen master and moment storage (see the module for the update).

    Args:
        params: parameters or param groups (groups may override every option
            below except ``fused``, ``seed``, ``block_size``, ``min_int8_numel``).
        lr: learning rate (finite, >= 0).
        betas: ``(beta1, beta2)``, each in [0, 1]: the interpolation of the update
            and the decay of the moment.
        weight_decay: decoupled weight decay (finite, >= 0).
        maximize: maximize the objective instead of minimizing.
        foreach: accepted (no effect).
        fused, master, moments, seed, block_size, min_int8_numel: as `AdamW`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        master: str = DEFAULT_MASTER,
        moments: str = DEFAULT_MOMENTS,
        seed: int | None = None,
        block_size: int = 256,
        min_int8_numel: int = 4096,
    ) -> None:
        refuse_unsupported("", {"foreach": foreach})
        check_lion(lr, betas, weight_decay)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
            "maximize": maximize,
            "foreach": foreach,
            "master": master,
            "moments": moments,
        }
        super().__init__(
            params,
            defaults,
            fused=fused,
            seed=seed,
            block_size=block_size,
            min_int8_numel=min_int8_numel,
        )

    def _check_hyper(self, group: dict[str, Any]) -> None:
        check_lion(group["lr"], group["betas"], group["weight_decay"])

    def _rule_for(self, group: dict[str, Any]) -> Rule:
        return RULES["lion"]
