"""The optimizer a plan implies, and whether a given optimizer can honour the plan.

`implied_param_groups` splits parameters as `Precision.optimizer` builds
`mixprec.optim.AdamW`: 16-bit parameters get the plan's master format, fp32
ones (islands, or everything under fp32 storage) need none. `check_optimizers`
refuses, before any update, an optimizer that would train 16-bit weights
without the master the plan asks for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.engine.gradients import SIXTEEN_BIT, optimizer_params
from mixprec.engine.plan import PrecisionPlan
from mixprec.errors import PrecisionError

__all__ = ["ParamsArg", "check_optimizers", "implied_param_groups"]

ParamsArg = nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def implied_param_groups(plan: PrecisionPlan, params: ParamsArg) -> list[dict[str, Any]]:
    """Param groups for `mixprec.optim.AdamW`: each given group split into its 16-bit
    parameters (with the plan's master) and its fp32 ones (``master="none"``)."""
    groups: list[dict[str, Any]] = []
    raw = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    if raw and isinstance(raw[0], dict):
        source = cast(list[dict[str, Any]], raw)
    else:
        source = [{"params": raw}]
    for group in source:
        tensors = list(group["params"])
        rest = {k: v for k, v in group.items() if k != "params"}
        half = [p for p in tensors if p.dtype != torch.float32]
        full = [p for p in tensors if p.dtype == torch.float32]
        if half:
            groups.append({"params": half, **rest, "master": plan.master.name})
        if full:
            groups.append({"params": full, **rest, "master": "none"})
    return groups


def check_optimizers(plan: PrecisionPlan, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Raise `PrecisionError` if an optimizer cannot honour `plan` (see
    `Precision.check_optimizers`)."""
    name = plan.policy_name
    storage = plan.storage_dtype
    master = plan.master.name
    for opt in optimizers:
        format_of = getattr(opt, "format_of", None)
        for p in optimizer_params(opt):
            if p.dtype not in SIXTEEN_BIT:
                continue
            if p.dtype != storage:
                raise PrecisionError(
                    f"policy {name!r} stores parameters in {dtype_name(storage)}, "
                    f"but {type(opt).__name__} holds a {dtype_name(p.dtype)} parameter of "
                    f"shape {tuple(p.shape)} (was the model cast after prec.prepare?); "
                    "let prec.prepare(model) set storage dtypes, then build the optimizer "
                    "with prec.optimizer(model)"
                )
            if master == "none":
                continue
            if format_of is None:
                raise PrecisionError(
                    f"policy {name!r} keeps a {master!r} master for "
                    f"{dtype_name(p.dtype)} parameters, which {type(opt).__name__} cannot "
                    "do (it updates 16-bit weights directly and keeps its state in their "
                    "dtype); build the optimizer with prec.optimizer(model) or "
                    f"mixprec.optim.AdamW(..., master={master!r})"
                )
            kept, _moments = format_of(p)
            if kept == "none":
                raise PrecisionError(
                    f"policy {name!r} keeps a {master!r} master for "
                    f"{dtype_name(p.dtype)} parameters, but the optimizer keeps parameter "
                    f"{tuple(p.shape)} with no master (it was built before prec.prepare "
                    "cast the model, or with master='none'); call prec.prepare(model) "
                    "first, then prec.optimizer(model)"
                )
