"""`Adam`: a drop-in `torch.optim.Adam` (L2 weight decay, AMSGrad) over chosen formats."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.formats.registry import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim.options import check_hyper, refuse_unsupported
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.rules import RULES, Rule

__all__ = ["Adam"]


class Adam(RuleOptimizer):
    """Adam with a chosen master and moment storage; torch's signature and operation order.

    ``weight_decay`` adds the L2 term ``weight_decay * param`` to the gradient, as
    `torch.optim.Adam` does (``decoupled_weight_decay=True`` decays the weights
    instead: `AdamW`). ``amsgrad=True`` keeps the running maximum of the second
    moment as one more moment, in the chosen moment format. ``capturable=True`` and
    ``differentiable=True`` raise `ValueError`; ``foreach`` is accepted and changes
    nothing. ``amsgrad`` and ``decoupled_weight_decay`` decide a group's state when it
    is added: changing them afterwards is undefined.

    Args:
        params: parameters or param groups (groups may override every option
            below except ``fused``, ``seed``, ``block_size``, ``min_int8_numel``).
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
            differentiable, decoupled_weight_decay: as `torch.optim.Adam`.
        fused, master, moments, seed, block_size, min_int8_numel: as `AdamW`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master: str = DEFAULT_MASTER,
        moments: str = DEFAULT_MOMENTS,
        seed: int | None = None,
        block_size: int = 256,
        min_int8_numel: int = 4096,
    ) -> None:
        options = {"capturable": capturable, "foreach": foreach, "differentiable": differentiable}
        refuse_unsupported("", options)
        check_hyper(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            **options,
            "decoupled_weight_decay": decoupled_weight_decay,
            "master": master,
            "moments": moments,
            "maximize": maximize,
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
        for key in ("amsgrad", "decoupled_weight_decay", "maximize"):
            if not isinstance(group.get(key, False), bool):
                raise TypeError(f"param group: {key} must be True or False, got {group[key]!r}")
        check_hyper(
            group["lr"],
            group["betas"],
            group["eps"],
            group["weight_decay"],
            foreach=group.get("foreach"),
            capturable=bool(group.get("capturable")),
        )

    def _rule_for(self, group: dict[str, Any]) -> Rule:
        name = "adamw" if group.get("decoupled_weight_decay", False) else "adam"
        return RULES[f"{name}_amsgrad" if group.get("amsgrad") else name]
