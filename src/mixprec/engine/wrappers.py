"""What a model's data-parallel wrappers do with precision: FSDP2 groups and DDP.

PyTorch's own engines do the communication: FSDP2 (`fully_shard`, each group
with a `MixedPrecisionPolicy`) and DDP (a communication hook, or its default
reduction in the gradients' dtype). `reductions` reads what a model's wrappers
will really do (the dtype each group's gradients are reduced in, the dtype
parameters are all-gathered and computed in, the output cast) from the wrappers
themselves, not from any configuration; `check_wrapped` compares it with a plan
(`Precision.prepare` calls it) so a policy's ``reduce_dtype`` and
``output_dtype`` are honoured or refused, never ignored. `mixprec.distributed`
builds wrappers that pass; the doctor reports the same facts.

DDP's hook is opaque, so `mixprec.distributed.ddp` records the dtype its hook
reduces in on the DDP module (`mark_ddp_reduce_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.engine.plan import PrecisionPlan
from mixprec.errors import PrecisionError

__all__ = [
    "Reduction",
    "check_wrapped",
    "fsdp_modules",
    "is_ddp",
    "mark_ddp_reduce_dtype",
    "reductions",
    "storage_change_refused",
]

# On a DDP module built by `mixprec.distributed.ddp`: the dtype its hook reduces in.
_DDP_REDUCE_ATTR = "_mixprec_reduce_dtype"


@dataclass(frozen=True)
class Reduction:
    """How one wrapper (an FSDP2 group or a DDP module) communicates.

    Attributes:
        wrapper: ``"fsdp2"`` or ``"ddp"``.
        module: the wrapped module's qualified name (``""``: the root).
        reduce_dtype: the dtype gradients are reduced in.
        param_dtype: the dtype FSDP2 all-gathers and computes parameters in (DDP:
            the storage dtype; None when the group holds no parameters).
        output_dtype: the dtype FSDP2 casts the module's outputs to, or None.
        mixed_precision_policy: whether an FSDP2 group was given a
            `MixedPrecisionPolicy` other than the default (DDP: whether mixprec's
            reduction hook is registered).
        numel: floating trainable parameter elements the wrapper reduces gradients of.
    """

    wrapper: str
    module: str
    reduce_dtype: torch.dtype | None
    param_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    mixed_precision_policy: bool
    numel: int


def is_ddp(model: nn.Module) -> bool:
    """Whether `model` is a `DistributedDataParallel` module."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` that `fully_shard` was applied to, with their names."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]  # type: ignore[misc]


def mark_ddp_reduce_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Record on a DDP module the dtype its registered hook reduces gradients in."""
    setattr(model, _DDP_REDUCE_ATTR, dtype)


def _trainable_floating(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.requires_grad and p.is_floating_point()]


def _fsdp_reduction(name: str, module: nn.Module) -> Reduction:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    state = module._get_fsdp_state()  # type: ignore[operator]
    mp = state._mp_policy
    group = state._fsdp_param_group
    fsdp_params = [] if group is None else group.fsdp_params
    trainable = [fp for fp in fsdp_params if fp.sharded_param.requires_grad]
    orig = trainable[0].sharded_param.dtype if trainable else None
    param_dtype = mp.param_dtype or orig
    return Reduction(
        wrapper="fsdp2",
        module=name,
        reduce_dtype=mp.reduce_dtype or param_dtype,
        param_dtype=param_dtype,
        output_dtype=mp.output_dtype,
        mixed_precision_policy=mp != MixedPrecisionPolicy(),
        numel=sum(fp.sharded_param.numel() for fp in trainable),
    )


def reductions(model: nn.Module) -> list[Reduction]:
    """How `model`'s gradients are communicated: one `Reduction` per FSDP2 group
    (root last) or per gradient dtype of a DDP module; empty for a model with no
    data-parallel wrapper."""
    if is_ddp(model):
        params = _trainable_floating(list(model.parameters()))
        hooked: torch.dtype | None = getattr(model, _DDP_REDUCE_ATTR, None)
        numels: dict[torch.dtype, int] = {}
        for p in params:
            numels[p.dtype] = numels.get(p.dtype, 0) + p.numel()
        return [
            Reduction(
                wrapper="ddp",
                module="",
                reduce_dtype=hooked or dtype,  # DDP's default: the gradients' own dtype
                param_dtype=dtype,
                output_dtype=None,
                mixed_precision_policy=hooked is not None,
                numel=n,
            )
            for dtype, n in numels.items()
        ]
    found = [_fsdp_reduction(n, m) for n, m in fsdp_modules(model)]
    return sorted(found, key=lambda r: r.module == "")  # the root last


def storage_change_refused(model: nn.Module, changes: int, plan: PrecisionPlan) -> None:
    """Raise `PrecisionError` when `changes` parameters of a wrapped `model` would
    change dtype: FSDP2 and DDP keep their own views of the parameters as they were
    when they wrapped them, so storage must be set before wrapping."""
    if not changes:
        return
    if is_ddp(model):
        wrapper, fix = "DistributedDataParallel", "mixprec.distributed.ddp(model, policy)"
    elif fsdp_modules(model):
        wrapper, fix = "fully_shard (FSDP2)", "mixprec.distributed.shard(model, policy)"
    else:
        return
    raise PrecisionError(
        f"prepare would change the dtype of {changes} parameter(s) of a model already "
        f"wrapped by {wrapper} under policy {plan.policy_name!r}; the wrapper keeps its own "
        "copy of the parameters as they were, so storage must be set first: call "
        f"prec.prepare(model) before wrapping, or wrap with {fix}, which sets the policy's "
        "storage and then wraps (prepare afterwards is then fine)"
    )


def check_wrapped(model: nn.Module, plan: PrecisionPlan) -> None:
    """Refuse a wrapped `model` whose communication differs from the plan's
    ``reduce_dtype`` or ``output_dtype`` (see the module docs).

    Raises:
        PrecisionError: a wrapper reduces in another dtype, or casts outputs to
            another dtype than the plan says, or the plan sets an output dtype
            that no FSDP2 root applies.
    """
    found = reductions(model)
    name = plan.policy_name
    wrong = [
        r
        for r in found
        if r.numel and r.reduce_dtype is not None and r.reduce_dtype != plan.reduce_dtype
    ]
    if wrong:
        r = wrong[0]
        fix = (
            "mixprec.distributed.ddp(model, policy)"
            if r.wrapper == "ddp"
            else "mixprec.distributed.shard(model, policy), or "
            f"fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype="
            f"torch.{str(plan.reduce_dtype).removeprefix('torch.')}))"
        )
        where = f" group {r.module!r}" if r.wrapper == "fsdp2" and r.module else ""
        raise PrecisionError(
            f"policy {name!r} reduces gradients in {dtype_name(plan.reduce_dtype)}, but this "
            f"model's {r.wrapper}{where} reduces them in {dtype_name(r.reduce_dtype)} "
            f"({len(wrong)} of {len(found)} wrapper group(s)); wrap with {fix}"
        )
    if plan.output_dtype is None:
        return
    roots = [r for r in found if r.wrapper == "fsdp2" and r.module == ""]
    if not roots or roots[0].output_dtype != plan.output_dtype:
        seen = "no FSDP2 root" if not roots else f"{dtype_name(roots[0].output_dtype)} outputs"
        raise PrecisionError(
            f"policy {name!r} casts module outputs to {dtype_name(plan.output_dtype)}, which "
            f"only an FSDP2 root applies, and this model has {seen}; wrap it with "
            "mixprec.distributed.shard(model, policy), or use output_dtype=None"
        )
