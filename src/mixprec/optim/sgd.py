"""`SGD`: a drop-in `torch.optim.SGD` (momentum, dampening, Nesterov) over chosen formats."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.formats.registry import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim.options import check_sgd, refuse_unsupported
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.rules import RULES, Rule

__all__ = ["SGD"]


class SGD(RuleOptimizer):
    """SGD with a chosen master and momentum storage; torch's signature and operation order.

    With ``momentum > 0`` the momentum buffer is one moment (``momentum_buffer``),
    kept in the chosen moment format; as in torch it starts as the first gradient
    (``dampening`` applies from the second step). ``weight_decay`` adds the L2 term
    to the gradient. Whether a group has momentum (``momentum > 0``) and
    ``nesterov`` decide its state when it is added: a group added with
    ``momentum=0`` refuses a momentum set later (a scheduler cycling momentum needs
    a momentum from the start); its value may change freely. ``differentiable=True``
    raises `ValueError`; ``foreach`` is accepted and changes nothing.

    Args:
        params: parameters or param groups (groups may override every option
            below except ``fused``, ``seed``, ``block_size``, ``min_int8_numel``).
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach,
            differentiable: as `torch.optim.SGD`.
        fused, master, moments, seed, block_size, min_int8_numel: as `AdamW`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master: str = DEFAULT_MASTER,
        moments: str = DEFAULT_MOMENTS,
        seed: int | None = None,
        block_size: int = 256,
        min_int8_numel: int = 4096,
    ) -> None:
        refuse_unsupported("", {"foreach": foreach, "differentiable": differentiable})
        check_sgd(lr, momentum, dampening, weight_decay, nesterov)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
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
        check_sgd(
            group["lr"],
            group["momentum"],
            group["dampening"],
            group["weight_decay"],
            group["nesterov"],
        )

    def _rule_for(self, group: dict[str, Any]) -> Rule:
        # (a momentum a scheduler sets later on a group added without one is refused by
        # the rule's read, `rules._sgd_plain_read`: the rule is the one it was added with)
        if group["nesterov"]:
            return RULES["sgd_nesterov"]
        return RULES["sgd_momentum" if group["momentum"] else "sgd"]
