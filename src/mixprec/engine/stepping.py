"""The step decision: one verdict for every optimizer, and non-finite steps skipped.

A step is applied only when every gradient of every optimizer it is given is
finite (decided on every rank together); with loss scaling it goes through
`GradScaler.step` and `GradScaler.update`, without it the same check still
skips the step. Closure steps (LBFGS) evaluate the closure here, unscale and
check each evaluation, and roll back a step that meets non-finite gradients.
A non-finite update is one thing this cannot see before it is applied: finite
gradients whose update takes a weight past the range of its storage format.
fp16 is the one storage format where that is ordinary (max 65504; bf16 shares
fp32's range), so after an applied update the parameters stored in fp16 are
checked (`count_nonfinite_weights`) and the count reported, never undone.
`record_step` turns the outcome into a `StepReport` and telemetry;
`check_collapse` stops a run whose loss scale or skip count says it is stuck.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from mixprec.engine.gradients import (
    agree_across_ranks,
    any_across_ranks,
    count_nonfinite,
    has_grads,
    optimizer_params,
    plain,
    total_norm,
)
from mixprec.engine.plan import PrecisionPlan
from mixprec.engine.scaling import ScaledGradients, update_scale
from mixprec.errors import PrecisionError
from mixprec.optim.sharding import is_dtensor
from mixprec.telemetry import PrecisionStats, StepReport

__all__ = [
    "WEIGHT_OVERFLOW_WARNING",
    "ClipNote",
    "Closure",
    "StepOutcome",
    "check_collapse",
    "check_grads",
    "count_nonfinite_weights",
    "record_step",
    "run_step",
    "step_plain",
    "step_with_closure",
]

Closure = Callable[[], Any]

#: Said once per `Precision`, at the first applied update that left fp16 weights
#: inf or NaN (`StepReport.nonfinite_weights` counts them at every step).
WEIGHT_OVERFLOW_WARNING = (
    "step {step}: the update overflowed fp16 storage: {count} elements of parameters "
    "stored in fp16 are now inf or NaN (fp16 holds at most 65504). The gradients were "
    "finite, so the step was applied; an overflow of the new weights is not undone. "
    "Lower the learning rate or weight decay, or store parameters in bf16 (fp32's range); "
    "StepReport.nonfinite_weights counts such elements at every step"
)


class StepOutcome(NamedTuple):
    """What a step did: applied or not, the reported norm, non-finite gradient
    elements seen, non-finite fp16 weight elements after the update, and on a
    skipped step whether its loss was finite."""

    applied: bool
    grad_norm: float
    nonfinite: int
    nonfinite_weights: int = 0
    loss_finite: bool | None = None


@dataclass(frozen=True)
class ClipNote:
    """What the step's clip saw: its pre-clip 2-norm (None for other norms) and the
    ids of the parameters with gradients it covered. Used for the report only."""

    norm: torch.Tensor | None
    param_ids: frozenset[int]


class _NonFiniteInClosureError(Exception):
    """Raised inside a wrapped closure to abort an optimizer step with bad gradients."""


def check_grads(
    optimizers: Sequence[torch.optim.Optimizer], clip: ClipNote | None
) -> tuple[float, int]:
    """The reported gradient norm and the count of non-finite gradient elements.

    The decision covers every gradient of every optimizer: one fused norm over all
    of them, read with one host sync (together with a clip's pre-clip norm, which
    is reported when that clip saw every gradient).
    """
    params = [p for opt in optimizers for p in optimizer_params(opt) if p.grad is not None]
    grads = [cast(torch.Tensor, p.grad) for p in params]
    if not grads:
        return 0.0, 0
    total = total_norm(grads).float()
    pending = clip.norm if clip is not None else None
    clip_saw_all = (
        clip is not None and pending is not None and {id(p) for p in params} <= clip.param_ids
    )
    if clip_saw_all and pending is not None:
        values = torch.stack([total, plain(pending).float().to(total.device)]).tolist()
        now, norm = values[0], values[1]
    else:
        now = norm = float(total)
    if math.isfinite(now) and math.isfinite(norm):
        return norm, 0
    # The norm can overflow fp32 on finite gradients (an element of 2e19): decide on
    # the elements themselves, not on the norm.
    return (norm if not math.isfinite(norm) else now), count_nonfinite(grads)


def count_nonfinite_weights(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """How many elements of the fp16-stored parameters just updated are inf or NaN.

    Only parameters with a gradient (the ones an update wrote) stored in fp16 are
    read: one min/max per parameter, read with one host sync (an exact count only
    when something is non-finite). A sharded (`DTensor`) parameter is counted on
    this rank's shard, without a collective.
    """
    weights = [
        p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]
        for opt in optimizers
        for p in optimizer_params(opt)
        if p.grad is not None and p.dtype == torch.float16
    ]
    weights = [w.detach() for w in weights if w.numel()]
    if not weights:
        return 0
    extremes = torch.stack([e for w in weights for e in torch.aminmax(w)])
    if bool(torch.isfinite(extremes).all()):
        return 0
    return count_nonfinite(weights)


def _overflowed(plan: PrecisionPlan, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """`count_nonfinite_weights` under fp16 storage; 0 otherwise (nothing to read)."""
    return count_nonfinite_weights(optimizers) if plan.storage_dtype == torch.float16 else 0


def step_plain(
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    plan: PrecisionPlan,
    scaler: torch.amp.GradScaler,
    grads: ScaledGradients,
    clip: ClipNote | None,
    device: torch.device,
    notify: Callable[[], None],
) -> StepOutcome:
    """Apply every optimizer's update, or none of them (see the module docs).

    Raises:
        PrecisionError: under loss scaling, gradients that did not (all) come
            through `Precision.backward`.
    """
    if not any(has_grads(opt) for opt in optimizers):
        notify()
        return StepOutcome(True, 0.0, 0)  # nothing to apply (and nothing a scaler has seen)
    name = plan.policy_name
    if plan.scales_loss and grads.accumulation.unscaled_seen:
        raise PrecisionError(
            f"policy {name!r} scales the loss, but part of these gradients came "
            "from a backward that did not go through prec.backward(loss) (a "
            "loss.backward() among prec.backward calls?): those parts are unscaled and "
            "would be divided by the loss scale; call prec.backward(loss) for every loss"
        )
    if plan.scales_loss and not grads.backward_pending:
        raise PrecisionError(
            f"policy {name!r} scales the loss, but these gradients did not come "
            "through prec.backward(loss) (was it loss.backward()?): they are unscaled, and "
            "unscaling them again would shrink them by the loss scale; call "
            "prec.backward(loss) instead"
        )
    grads.unscale(scaler, optimizers)
    # One decision for every optimizer of the step, taken on every rank together, and
    # reported the same on every rank.
    norm, nonfinite = agree_across_ranks(*check_grads(optimizers, clip), device)
    notify()
    bad = nonfinite > 0
    ls = plan.loss_scaling
    if ls is not None and ls.dynamic:
        if bad:
            update_scale(scaler, ls, found_inf=True)  # back off, as GradScaler does
            return StepOutcome(False, norm, nonfinite, loss_finite=grads.loss_was_finite())
        stepping = [opt for opt in optimizers if has_grads(opt)]
        for opt in stepping:
            scaler.step(opt)
        if stepping:
            scaler.update()
        else:  # nothing was unscaled: end the iteration without moving the scale
            scaler.update(new_scale=float(scaler.get_scale()))
        return StepOutcome(True, norm, nonfinite, _overflowed(plan, optimizers))
    if not bad:
        for opt in optimizers:
            opt.step()
    if ls is not None:
        # Static scale: end GradScaler's iteration without moving the scale.
        scaler.update(new_scale=float(ls.init_scale))
    if bad:
        return StepOutcome(False, norm, nonfinite, loss_finite=grads.loss_was_finite())
    return StepOutcome(True, norm, nonfinite, _overflowed(plan, optimizers))


def step_with_closure(
    optimizer: torch.optim.Optimizer,
    closure: Closure,
    *,
    plan: PrecisionPlan,
    scaler: torch.amp.GradScaler,
    grads: ScaledGradients,
    clip: ClipNote | None,
    device: torch.device,
    notify: Callable[[], None],
) -> StepOutcome:
    """A closure step (LBFGS): every evaluation unscaled and checked, a step that meets
    non-finite gradients rolled back (parameters and optimizer state restored)."""
    opt = optimizer
    with torch.enable_grad():
        first_loss = closure()
    grads.unscale(scaler, [opt])
    norm, nonfinite = agree_across_ranks(*check_grads([opt], clip), device)
    notify()
    if nonfinite > 0:
        update_scale(scaler, plan.loss_scaling, found_inf=True)
        return StepOutcome(False, norm, nonfinite, loss_finite=grads.loss_was_finite())
    params = optimizer_params(opt)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    scale = float(scaler.get_scale()) if plan.scales_loss else None
    inv_scale = 1.0 / (scale or 1.0)
    calls = 0

    def wrapped() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # gradients of the first evaluation are already unscaled
            return first_loss
        with torch.enable_grad():
            loss = closure()
        evaluated = [p.grad for p in params if p.grad is not None]
        if inv_scale != 1.0:
            torch._foreach_mul_(evaluated, inv_scale)
        if any_across_ranks(not math.isfinite(float(total_norm(evaluated))), device):
            raise _NonFiniteInClosureError
        return loss

    try:
        if plan.scales_loss:
            scaler.step(opt, wrapped)  # positional: GradScaler only refuses kwargs
        else:
            opt.step(wrapped)
    except _NonFiniteInClosureError:
        with torch.no_grad():
            for p, saved in zip(params, saved_params, strict=True):
                p.copy_(saved)
        opt.load_state_dict(saved_state)
        update_scale(scaler, plan.loss_scaling, found_inf=True)
        return StepOutcome(False, norm, max(nonfinite, 1), loss_finite=grads.loss_was_finite())
    update_scale(scaler, plan.loss_scaling, found_inf=False)
    return StepOutcome(True, norm, nonfinite, _overflowed(plan, [opt]))


def run_step(
    optimizers: Sequence[torch.optim.Optimizer],
    closure: Closure | None,
    *,
    plan: PrecisionPlan,
    scaler: torch.amp.GradScaler,
    grads: ScaledGradients,
    clip: ClipNote | None,
    device: torch.device,
    notify: Callable[[], None],
) -> StepOutcome:
    """`step_with_closure` when a closure is given (one optimizer), else `step_plain`;
    `notify` runs once the gradients are final, before any update.

    Raises:
        ValueError: a closure with several optimizers.
    """
    if closure is None:
        return step_plain(
            optimizers,
            plan=plan,
            scaler=scaler,
            grads=grads,
            clip=clip,
            device=device,
            notify=notify,
        )
    if len(optimizers) != 1:
        raise ValueError("a closure step takes exactly one optimizer")
    return step_with_closure(
        optimizers[0],
        closure,
        plan=plan,
        scaler=scaler,
        grads=grads,
        clip=clip,
        device=device,
        notify=notify,
    )


def record_step(
    stats: PrecisionStats,
    outcome: StepOutcome,
    *,
    scale_before: float | None,
    scale_after: float | None,
    stepped: tuple[bool, ...],
) -> StepReport:
    """Count the step in `stats` and return its `StepReport`."""
    index = stats.steps
    stats.steps += 1
    if outcome.applied:
        stats.applied_steps += 1
        stats.consecutive_skips = 0
    else:
        stats.skipped_steps += 1
        stats.consecutive_skips += 1
    if outcome.nonfinite:
        stats.last_nonfinite_step = index
    if scale_after is not None:
        stats.record_scale(stats.steps, scale_after)
    return StepReport(
        step=index,
        applied=outcome.applied,
        scale=scale_before,
        next_scale=scale_after,
        grad_norm=outcome.grad_norm,
        nonfinite_grads=outcome.nonfinite,
        stepped=stepped,
        nonfinite_weights=outcome.nonfinite_weights,
        loss_finite=outcome.loss_finite,
    )


def check_collapse(
    stats: PrecisionStats,
    *,
    min_loss_scale: float | None,
    max_consecutive_skips: int | None,
    loss_finite: bool | None = None,
) -> None:
    """Raise `PrecisionError` when the loss scale fell below `min_loss_scale` or
    `max_consecutive_skips` steps in a row were skipped (None: never); the message
    says where the overflow was seen from `loss_finite` (the last step's
    `StepReport.loss_finite`)."""
    history = ", ".join(f"step {s}: {v:g}" for s, v in list(stats.scale_history)[-12:])
    scale = stats.loss_scale
    if scale is not None and min_loss_scale is not None and scale < min_loss_scale:
        raise PrecisionError(
            f"the loss scale collapsed to {scale:g} (below {min_loss_scale:g}) after "
            f"{stats.consecutive_skips} consecutive skipped steps; gradients are non-finite "
            f"even unscaled: {_where_seen(loss_finite)}. Recent loss scales: {history}. "
            f"{_where_fix(loss_finite)}"
        )
    limit = max_consecutive_skips
    if limit is not None and stats.consecutive_skips >= limit:
        raise PrecisionError(
            f"{stats.consecutive_skips} consecutive steps had non-finite gradients and were "
            f"skipped (limit max_consecutive_skips={limit}); training is not progressing: "
            f"{_where_seen(loss_finite)}. "
            + (f"Recent loss scales: {history}. " if history else "")
            + _where_fix(loss_finite)
        )


def _where_seen(loss_finite: bool | None) -> str:
    if loss_finite is None:
        return "the loss did not go through prec.backward, so where is not known"
    if loss_finite:
        return (
            "the loss was finite, so the overflow is in the backward pass (a gradient "
            "past the compute format's range)"
        )
    return "the loss itself was inf/NaN, so the forward pass or the loss produces it"


def _where_fix(loss_finite: bool | None) -> str:
    if loss_finite:
        return (
            "Scale the loss down (a mean rather than a sum, a smaller multiplier: the "
            "gradient of a large loss is large in every layer), keep the layers the "
            "gradient overflows in fp32 (Policy.fp32_modules), or compute in bf16"
        )
    return (
        "Find the source with mixprec's doctor (nonfinite-source), lower the learning "
        "rate, or compute in bf16"
    )
