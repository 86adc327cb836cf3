"""`AdamW`: a drop-in `torch.optim.AdamW` with explicit master and moment formats."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from mixprec.formats.registry import DEFAULT_MASTER, DEFAULT_MOMENTS
from mixprec.optim.adam import Adam
from mixprec.optim.rules import RULES, Rule

__all__ = ["AdamW"]


class AdamW(Adam):
    """AdamW with decoupled weight decay and a chosen master/moment storage.

    Takes `torch.optim.AdamW`'s signature; bias correction and operation order
    follow it. Parameters may be fp32, bf16 or fp16 (float64 raises: the update
    is computed in fp32). ``amsgrad=True`` keeps the running maximum of the second
    moment as one more moment, in the chosen moment format. torch options it cannot
    honour raise `ValueError` instead of being ignored: ``capturable=True``,
    ``differentiable=True`` (also per group). ``foreach`` is accepted and changes
    nothing: every step already runs as fused kernels.

    Args:
        params: parameters or param groups (groups may override every option
            below except ``fused``, ``seed``, ``block_size``, ``min_int8_numel``).
        lr: learning rate (>= 0), a float or a 1-element Tensor.
        betas: moment decay rates, each in [0, 1) (floats, or both 1-element Tensors).
        eps: denominator term (> 0).
        weight_decay: decoupled weight decay (>= 0).
        amsgrad: keep the running maximum of the second moment (fixed when a group
            is added: it decides the group's state).
        foreach: accepted for torch compatibility (no effect).
        capturable: must be False.
        differentiable: must be False.
        master: how full precision is kept for 16-bit params: ``"auto"``
            (``none`` for fp32 params, ``exact`` for bf16, ``fp32`` for fp16)
            or a registered master format, for the 16-bit parameters; fp32 parameters
            (fp32 islands) are their own master. A master where every parameter
            is fp32 raises (the model was not cast).
        moments: ``"fp32"``, ``"bf16"`` or ``"int8"`` (params with fewer than
            ``min_int8_numel`` elements, or a size that is not a multiple of
            ``block_size``, keep fp32 moments; see `formats`).
        maximize: maximize the objective instead of minimizing.
        fused: ``True``: every step fused, on CPU by the native C++ kernel
            (`mixprec.optim.native`), elsewhere by `torch.compile` (a failure
            raises); ``False``: eager; ``None``: native on CPU, compiled on CUDA
            with an eager fallback (`kernels.resolve_mode`). Results are bitwise
            identical in every mode.
        seed: seed of the stochastic-rounding noise (``None``: read from torch's
            default generator without advancing it).
        block_size: elements per int8 quantization block.
        min_int8_numel: size below which int8 moments stay fp32.

    Raises:
        ValueError: for a bad hyperparameter, an unknown master or moments
            name, or a master that does not fit a parameter's dtype.
        TypeError: for a ``fused`` that is not a bool or None.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master: str = DEFAULT_MASTER,
        moments: str = DEFAULT_MOMENTS,
        seed: int | None = None,
        block_size: int = 256,
        min_int8_numel: int = 4096,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            master=master,
            moments=moments,
            seed=seed,
            block_size=block_size,
            min_int8_numel=min_int8_numel,
        )

    def _rule_for(self, group: dict[str, Any]) -> Rule:
        return RULES["adamw_amsgrad" if group.get("amsgrad") else "adamw"]

    def _check_hyper(self, group: dict[str, Any]) -> None:
        if group.get("decoupled_weight_decay", True) is not True:
            raise ValueError(
                "param group: decoupled_weight_decay=False (Adam with L2 decay) is not "
                "AdamW: use mixprec.optim.Adam for L2 decay, or drop the key"
            )
        super()._check_hyper(group)
