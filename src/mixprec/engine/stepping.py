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
`Precision.step` gathers what a step works with into a `StepContext` and calls
`step_plain` (or `step_with_closure`); `record_step` turns the outcome into a
`StepReport` and telemetry; `check_collapse` stops a run whose loss scale or
skip count says it is stuck.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from mixprec.engine.gradients import (
    agree_across_ranks,
    any_across_ranks,
    count_nonfinite,
    optimizer_params,
    plain,
    total_norm,
)
from mixprec.engine.observers import StepObserver
from mixprec.engine.plan import PrecisionPlan
from mixprec.engine.scaling import ScaledGradients, update_scale
from mixprec.errors import PrecisionError
from mixprec.optim.sharding import is_dtensor
from mixprec.telemetry import PrecisionStats, StepReport

if TYPE_CHECKING:
    from mixprec.engine.precision import Precision

__all__ = [
    "WEIGHT_OVERFLOW_WARNING",
    "ClipNote",
    "Closure",
    "StepContext",
    "StepOutcome",
    "check_collapse",
    "check_grads",
    "check_limits",
    "check_max_norm",
    "count_nonfinite_weights",
    "record_step",
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
    """What a step did: applied or not, which optimizers applied an update (those
    with gradients, when applied), the reported norm, non-finite gradient elements
    seen, non-finite fp16 weight elements after the update, on a skipped step
    whether its loss was finite, and under gradient release the parameters stepped
    in backward and those withheld (`mixprec.engine.release`)."""

    applied: bool
    stepped: tuple[bool, ...]
    grad_norm: float
    nonfinite: int
    nonfinite_weights: int = 0
    loss_finite: bool | None = None
    released: int = 0
    withheld: int = 0


@dataclass(frozen=True)
class ClipNote:
    """What the step's clip saw: its pre-clip 2-norm (None for other norms) and the
    ids of the parameters with gradients it covered. Used for the report only."""

    norm: torch.Tensor | None
    param_ids: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What one `Precision.step` works with, gathered once by it for `step_plain` or
    `step_with_closure`.

    Attributes:
        plan: the run's plan.
        scaler: the run's `GradScaler` (disabled without loss scaling: a no-op).
        grads: where this step's gradients stand (unscaled or not, backward pending).
        device: where the tensors of a cross-rank agreement live.
        clip: what this step's `Precision.clip_grad_norm_` saw, or None.
        loss_was_finite: whether every loss given to `Precision.backward` this step
            (closure evaluations included) was finite, None if none was; read on a skip.
        observers: called once the gradients are final, before the update.
        owner: the `Precision` the observers are given.
        step: this step's index (`PrecisionStats.steps` before it).
    """

    plan: PrecisionPlan
    scaler: torch.amp.GradScaler
    grads: ScaledGradients
    device: torch.device
    clip: ClipNote | None
    loss_was_finite: Callable[[], bool | None]
    observers: Sequence[StepObserver]
    owner: Precision
    step: int


class _NonFiniteInClosureError(Exception):
    """Raised inside a wrapped closure to abort an optimizer step with bad gradients."""


def check_limits(
    max_consecutive_skips: object, min_loss_scale: object, history_size: object
) -> None:
    """`Precision`'s collapse limits and history size, refused unless valid.

    Raises:
        ValueError: naming the bad value.
    """
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips must be an int >= 1 or None, got {max_consecutive_skips!r}"
        )
    if min_loss_scale is not None and (
        isinstance(min_loss_scale, bool)
        or not isinstance(min_loss_scale, int | float)
        or not 0.0 < min_loss_scale < math.inf
    ):
        raise ValueError(
            f"min_loss_scale must be a finite number > 0 or None, got {min_loss_scale!r}"
        )
    if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
        raise ValueError(f"history_size must be an int >= 1, got {history_size!r}")


def check_max_norm(max_norm: object) -> float:
    """`max_norm` of a clip as a float, refused unless a number > 0 (`float('inf')`
    only measures the norm).

    Raises:
        TypeError: not a number.
        ValueError: 0, negative or NaN.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | torch.Tensor):
        raise TypeError(f"max_norm must be a number > 0 (e.g. 1.0), got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:  # also refuses NaN
        raise ValueError(
            f"max_norm must be > 0 (e.g. 1.0; float('inf') only measures the norm), got "
            f"{value!r}: 0 zeroes every gradient and a negative value trains by "
            "gradient ascent"
        )
    return value


def check_grads(
    params: Sequence[torch.Tensor],
    clip: ClipNote | None,
    device: torch.device,
    found_inf: Sequence[torch.Tensor] = (),
) -> tuple[float, int]:
    """The reported gradient norm and the count of non-finite gradient elements of
    `params` (the parameters with a gradient of every optimizer of the step), as every
    rank reports them (`agree_across_ranks`, under a process group).

    The decision covers every one of those gradients: one fused norm over all of
    them, read with one host sync (together with a clip's pre-clip norm, which is
    reported when that clip saw every gradient, and `found_inf`, what GradScaler's
    unscale found: a gradient that was inf/NaN then and was clamped since counts as
    one non-finite element, since GradScaler skips its update).
    """
    # Without a process group there is no other rank and no DTensor (FSDP2's gradients,
    # whose norms are made whole with `plain`, a collective).
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    grads: list[torch.Tensor] = []
    for p in params:
        grads.append(cast(torch.Tensor, p.grad))
    norm, nonfinite = 0.0, 0
    if grads:
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
        pending = None  # a clip's pre-clip norm, when that clip saw every gradient
        if (
            clip is not None
            and clip.norm is not None
            and clip.param_ids.issuperset(map(id, params))
        ):
            pending = clip.norm
        if distributed:
            total = plain(total)
            pending = None if pending is None else plain(pending)
        read = [total.float()]
        if pending is not None:
            read.append(pending.float().to(total.device))
        for found in found_inf:  # shape () or (1,) (ShardedGradScaler's)
            read.append(found.float().sum().to(total.device))
        values = torch.stack(read).tolist() if len(read) > 1 else [float(read[0])]
        now = values[0]
        norm = values[1] if pending is not None else now
        if not (math.isfinite(now) and math.isfinite(norm)):
            # The norm can overflow fp32 on finite gradients (an element of 2e19): decide
            # on the elements themselves, not on the norm.
            norm = norm if not math.isfinite(norm) else now
            nonfinite = count_nonfinite(grads)
        if nonfinite == 0 and any(values[1 + (pending is not None) :]):
            nonfinite = 1  # inf/NaN at the unscale, clamped since
    if distributed:
        return agree_across_ranks(norm, nonfinite, device)
    return norm, nonfinite


def count_nonfinite_weights(params: Sequence[torch.Tensor]) -> int:
    """How many elements of the fp16-stored parameters among `params` (those an update
    just wrote) are inf or NaN.

    One min/max per parameter, read with one host sync (an exact count only when
    something is non-finite). A sharded (`DTensor`) parameter is counted on this
    rank's shard, without a collective.
    """
    weights = [
        p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]
        for p in params
        if p.dtype == torch.float16
    ]
    weights = [w.detach() for w in weights if w.numel()]
    if not weights:
        return 0
    extremes = torch.stack([e for w in weights for e in torch.aminmax(w)])
    if bool(torch.isfinite(extremes).all()):
        return 0
    return count_nonfinite(weights)


def step_plain(ctx: StepContext, optimizers: Sequence[torch.optim.Optimizer]) -> StepOutcome:
    """Apply every optimizer's update, or none of them (see the module docs).

    Raises:
        PrecisionError: under loss scaling, gradients that did not (all) come
            through `Precision.backward`.
    """
    plan, scaler, grads = ctx.plan, ctx.scaler, ctx.grads
    params: list[torch.Tensor] = []  # every parameter with a gradient
    stepping: list[bool] = []  # per optimizer: does it hold one
    for opt in optimizers:
        before = len(params)
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
        stepping.append(len(params) > before)
    with_grads = tuple(stepping)
    if not params:
        for observer in ctx.observers:
            observer.before_step(ctx.owner, optimizers, ctx.step)
        # Nothing to apply (and nothing a scaler has seen).
        return StepOutcome(True, with_grads, 0.0, 0)
    ls = plan.loss_scaling
    found: Sequence[torch.Tensor] = ()
    if ls is not None:
        grads.unscale(scaler, optimizers)  # refuses gradients not from prec.backward
        found = grads.found_inf()
    # One decision for every optimizer of the step, taken on every rank together, and
    # reported the same on every rank.
    norm, nonfinite = check_grads(params, ctx.clip, ctx.device, found)
    for observer in ctx.observers:
        observer.before_step(ctx.owner, optimizers, ctx.step)
    if nonfinite > 0:
        update_scale(scaler, ls, found_inf=True)  # back off (dynamic), as GradScaler does
        skipped = (False,) * len(optimizers)
        return StepOutcome(False, skipped, norm, nonfinite, loss_finite=ctx.loss_was_finite())
    if ls is not None and ls.dynamic:
        for opt, has in zip(optimizers, with_grads, strict=True):
            if has:
                scaler.step(opt)
        scaler.update()
    else:
        for opt in optimizers:
            opt.step()
        if ls is not None:
            # Static scale: end GradScaler's iteration without moving the scale.
            scaler.update(new_scale=float(ls.init_scale))
    fp16 = plan.storage_dtype == torch.float16  # the one storage format an update overflows
    return StepOutcome(True, with_grads, norm, 0, count_nonfinite_weights(params) if fp16 else 0)


def step_with_closure(
    ctx: StepContext, optimizer: torch.optim.Optimizer, closure: Closure
) -> StepOutcome:
    """A closure step (LBFGS): every evaluation unscaled and checked, a step that meets
    non-finite gradients rolled back (parameters and optimizer state restored)."""
    plan, scaler, grads, opt = ctx.plan, ctx.scaler, ctx.grads, optimizer
    params = optimizer_params(opt)
    had_grads = any(p.grad is not None for p in params)
    with torch.enable_grad():
        first_loss = closure()
    grads.unscale(scaler, [opt])
    with_grad = [p for p in params if p.grad is not None]
    norm, nonfinite = check_grads(with_grad, ctx.clip, ctx.device)
    for observer in ctx.observers:
        observer.before_step(ctx.owner, [opt], ctx.step)
    if nonfinite > 0:
        update_scale(scaler, plan.loss_scaling, found_inf=True)
        return StepOutcome(False, (False,), norm, nonfinite, loss_finite=ctx.loss_was_finite())
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    scale = float(scaler.get_scale()) if plan.loss_scaling is not None else None
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
        if any_across_ranks(not math.isfinite(float(total_norm(evaluated))), ctx.device):
            raise _NonFiniteInClosureError
        return loss

    try:
        if plan.loss_scaling is not None:
            scaler.step(opt, wrapped)  # positional: GradScaler only refuses kwargs
        else:
            opt.step(wrapped)
    except _NonFiniteInClosureError:
        with torch.no_grad():
            for p, saved in zip(params, saved_params, strict=True):
                p.copy_(saved)
        opt.load_state_dict(saved_state)
        update_scale(scaler, plan.loss_scaling, found_inf=True)
        return StepOutcome(
            False, (False,), norm, max(nonfinite, 1), loss_finite=ctx.loss_was_finite()
        )
    update_scale(scaler, plan.loss_scaling, found_inf=False)
    written = [p for p in params if p.grad is not None]
    fp16 = plan.storage_dtype == torch.float16
    return StepOutcome(
        True, (had_grads,), norm, nonfinite, count_nonfinite_weights(written) if fp16 else 0
    )


def record_step(
    stats: PrecisionStats,
    outcome: StepOutcome,
    *,
    scale_before: float | None,
    scale_after: float | None,
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
        stepped=outcome.stepped,
        nonfinite_weights=outcome.nonfinite_weights,
        loss_finite=outcome.loss_finite,
        released_params=outcome.released,
        withheld_params=outcome.withheld,
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
    scale = stats.loss_scale
    if scale is not None and min_loss_scale is not None and scale < min_loss_scale:
        raise PrecisionError(
            f"the loss scale collapsed to {scale:g} (below {min_loss_scale:g}) after "
            f"{stats.consecutive_skips} consecutive skipped steps; gradients are non-finite "
            f"even unscaled: {_where_seen(loss_finite)}. Recent loss scales: "
            f"{_recent_scales(stats)}. {_where_fix(loss_finite)}"
        )
    limit = max_consecutive_skips
    if limit is not None and stats.consecutive_skips >= limit:
        history = _recent_scales(stats)
        raise PrecisionError(
            f"{stats.consecutive_skips} consecutive steps had non-finite gradients and were "
            f"skipped (limit max_consecutive_skips={limit}); training is not progressing: "
            f"{_where_seen(loss_finite)}. "
            + (f"Recent loss scales: {history}. " if history else "")
            + _where_fix(loss_finite)
        )


def _recent_scales(stats: PrecisionStats) -> str:
    """The last loss-scale changes, for a collapse message."""
    return ", ".join(f"step {s}: {v:g}" for s, v in list(stats.scale_history)[-12:])


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
