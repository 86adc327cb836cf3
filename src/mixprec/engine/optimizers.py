"""The optimizer a plan implies, and whether a given optimizer can honour the plan.

`implied_param_groups` gives `Precision.optimizer` the user's param groups
exactly (same groups, same order, so per-group schedulers and torch checkpoints
fit), each with the plan's master unless the group names one; `build_optimizer`
makes a mixprec optimizer over them (`mixprec.optim.AdamW` by default, or `Adam`,
`SGD`, `Lion`), or `mixprec.optim.Mastered` for a torch optimizer class, which apply
it to the 16-bit parameters, fp32 ones (islands) being their own master.
`check_optimizers` refuses, before any update, an optimizer that would train 16-bit
weights without the master the plan asks for.
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

__all__ = [
    "ParamsArg",
    "build_optimizer",
    "check_optimizers",
    "implied_param_groups",
    "refuse_other_formats",
    "unwrapped",
]

ParamsArg = nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def refuse_other_formats(plan: PrecisionPlan, asked: dict[str, Any], *, where: str) -> None:
    """Raise `ValueError` if `asked` (keyword arguments or a param group) names a
    ``master``/``moments`` other than the plan's: the policy decides them."""
    for key, planned in (("master", plan.master.name), ("moments", plan.moments.name)):
        if key in asked and asked[key] != planned:
            raise ValueError(
                f"prec.optimizer: {where} asks for {key}={asked[key]!r}, but the policy "
                f"{plan.policy_name!r} decides {key} ({planned!r}); change the policy (e.g. "
                f"policy.replace({key}=...)), or build the mixprec optimizer yourself and "
                "prec.register(it)"
            )


def implied_param_groups(
    plan: PrecisionPlan, params: ParamsArg, *, islands: frozenset[int] = frozenset()
) -> list[dict[str, Any]]:
    """The user's param groups, unchanged but for the plan's master where a group names none.

    Args:
        plan: the run's plan.
        params: a model, parameters, or param groups.
        islands: ids of the parameters of fp32 islands (fp32 by design).

    Raises:
        PrecisionError: the plan stores parameters in 16 bits but every one given that
            is not an island's is fp32 (the optimizer is being built before `prepare`
            cast the model).
    """
    raw = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    if not raw:  # torch's message: AdamW([]) raises it too
        raise ValueError("optimizer got an empty parameter list")
    source = cast(list[dict[str, Any]], raw) if isinstance(raw[0], dict) else [{"params": raw}]
    for i, group in enumerate(source):
        refuse_other_formats(plan, group, where=f"param group {i}")
    groups = [{**group, "params": _items(group["params"])} for group in source]
    for group in groups:
        members = [t for t in map(_tensor, group["params"]) if t is not None]
        only_islands = bool(members) and all(id(t) in islands for t in members)
        # An island's fp32 parameters are their own master; a master asked for a group of
        # nothing else would be refused by AdamW as "the model was not cast".
        group["master"] = "none" if only_islands else plan.master.name
    tensors = [t for g in groups for t in map(_tensor, g["params"]) if t is not None]
    tensors = [t for t in tensors if id(t) not in islands]
    all_fp32 = bool(tensors) and all(t.dtype == torch.float32 for t in tensors)
    if plan.storage_dtype in SIXTEEN_BIT and all_fp32:
        raise PrecisionError(
            f"policy {plan.policy_name!r} stores parameters in {dtype_name(plan.storage_dtype)}, "
            "but every parameter given to prec.optimizer is fp32: the optimizer is being built "
            "before prec.prepare cast the model; call prec.prepare(model) first, then "
            "prec.optimizer(model)"
        )
    return groups


def build_optimizer(
    plan: PrecisionPlan,
    groups: list[dict[str, Any]],
    optimizer: type[torch.optim.Optimizer] | None,
    kwargs: dict[str, Any],
) -> torch.optim.Optimizer:
    """The optimizer `Precision.optimizer` builds over `groups` (`implied_param_groups`):
    a mixprec optimizer class (`mixprec.optim.AdamW` when `optimizer` is None, or
    `Adam`, `SGD`, `Lion`) with the plan's moments, else `mixprec.optim.Mastered` over
    the torch optimizer class `optimizer`.

    Raises:
        TypeError: `optimizer` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: the plan's moments are not ``fp32`` and `optimizer` is a torch class
            (its state is its own, fp32 as on fp32 parameters).
    """
    from mixprec.optim import AdamW, Mastered, RuleOptimizer

    optimizer = AdamW if optimizer is None else optimizer
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(
            f"prec.optimizer: optimizer={optimizer!r} is not an optimizer class; pass the "
            "class itself: mixprec.optim.AdamW, Adam, SGD or Lion, or a torch.optim class "
            "(torch.optim.Muon), with its arguments as keywords"
        )
    if issubclass(optimizer, RuleOptimizer):
        # (each subclass takes torch's signature plus master= and moments=)
        build: Any = optimizer
        return cast(torch.optim.Optimizer, build(groups, moments=plan.moments.name, **kwargs))
    if plan.moments.name != "fp32":
        raise ValueError(
            f"prec.optimizer: policy {plan.policy_name!r} keeps {plan.moments.name!r} "
            f"moments, which {getattr(optimizer, '__name__', optimizer)} cannot (a torch "
            "optimizer keeps its own state in fp32); use a mixprec optimizer "
            "(mixprec.optim.AdamW, Adam, SGD, Lion), or a policy with moments='fp32' "
            "(policy.replace(moments='fp32'))"
        )
    return Mastered(optimizer, groups, **kwargs)


def _items(params: object) -> list[Any]:
    # A group's params as a list (a generator is read once), names kept.
    return [params] if isinstance(params, torch.Tensor) else list(cast(Iterable[Any], params))


def _tensor(item: object) -> torch.Tensor | None:
    # torch accepts tensors and (name, tensor) pairs.
    if isinstance(item, tuple) and len(item) == 2:
        item = item[1]
    return item if isinstance(item, torch.Tensor) else None


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper holds as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, HF Trainer's), unwrapped to the innermost; `optimizer` itself
    when it wraps none. The wrapper is what steps (it may skip a step on purpose, as
    Accelerate does between accumulation boundaries); the inner one is what is checked."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def check_optimizers(plan: PrecisionPlan, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Raise `PrecisionError` if an optimizer cannot honour `plan` (see
    `Precision.check_optimizers`)."""
    name = plan.policy_name
    storage = plan.storage_dtype
    master = plan.master.name
    for opt in optimizers:
        format_of = getattr(unwrapped(opt), "format_of", None)
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
                    "dtype); build the optimizer with prec.optimizer(model, optimizer=...): "
                    "a mixprec class (AdamW, Adam, SGD, Lion) or a torch class, which it "
                    f"wraps in mixprec.optim.Mastered(..., master={master!r})"
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
