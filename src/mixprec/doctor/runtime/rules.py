"""The runtime rules: pure functions from probe measurements to findings.

`Probe` measures; these functions judge and word the findings, so they mirror
`mixprec.doctor.rules` (the static rules) and can be tested on plain values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.doctor.findings import Finding, Severity
from mixprec.doctor.rules.fixes import master_fix
from mixprec.doctor.runtime.hunter import NonfiniteHit
from mixprec.doctor.runtime.measure import (
    GradientStats,
    ScaledGradientChange,
    ScaleVerdict,
    UpdateStats,
    ZeroBreakdown,
)
from mixprec.dtypes import dtype_name, format_info

#: ``evidence["reference"]`` of a ``gradient-underflow`` split by an fp32 replay.
FP32_REPLAY = "fp32 replay"

#: A replay in which more than this share of the elements is non-zero in the run but
#: zero in fp32 is not the same step (a faithful one has none, but for a ReLU unit
#: that rounding tips across zero), so its split is not used.
UNFAITHFUL_REPLAY_SHARE = 0.01

__all__ = [
    "FP32_REPLAY",
    "UNFAITHFUL_REPLAY_SHARE",
    "clip_before_unscale",
    "grad_accum_16bit",
    "gradient_underflow",
    "loss_scale_collapse",
    "nonfinite_not_in_forward",
    "nonfinite_source",
    "vanishing_updates",
]


def _flushed_at_outputs(output_grads: GradientStats | None) -> bool:
    """Whether zeros in the gradient the loss sent into fp16 outputs look flushed.

    Rounding to fp16 flushes values below half its smallest subnormal; a loss whose
    gradient reaches that far also fills the subnormal range above it. So zeros
    count as flushed when every element is zero or some non-zero ones are
    subnormal; zeros among values all in fp16's normal range are exact zeros of
    the loss (it ignores those outputs).
    """
    if output_grads is None or output_grads.zeros == 0:
        return False
    return output_grads.zeros == output_grads.elements or output_grads.flush > 0


def _split_message(
    split: ZeroBreakdown,
    output_grads: GradientStats | None,
    *,
    flushed: bool,
    frac: float,
    step: int,
    scales: bool,
) -> str:
    fp16 = format_info(torch.float16)
    parts = []
    if split.underflow:
        parts.append(
            f"{split.underflow} elements whose fp32 gradient is non-zero (up to "
            f"{split.largest_lost:.3g}) fell, or the activation gradients they are summed "
            f"from fell, below fp16's smallest subnormal ({fp16.smallest_subnormal:.3g}) "
            "in backward"
        )
    if flushed and output_grads is not None:
        parts.append(
            f"{split.at_outputs} elements depend only on outputs whose gradient from the "
            f"loss flushed in its cast to fp16 ({output_grads.zeros} of the "
            f"{output_grads.elements} elements of that gradient were zero and "
            f"{output_grads.flush} more subnormal)"
        )
    message = (
        f"{frac:.1%} of the gradient elements that an fp32 replay of step {step} keeps were "
        f"exactly zero under fp16 compute{'' if scales else ' without loss scaling'}: "
        f"{' and '.join(parts)}. The other {split.structural} zero elements are zero in fp32 "
        "too (structural: always-zero inputs, inactive units) and are not counted"
    )
    if split.at_outputs and not flushed:
        message += (
            f", nor are {split.at_outputs} whose outputs' gradient is exactly zero in a "
            "gradient otherwise in fp16's normal range (a loss that ignores those outputs)"
        )
    return message


def gradient_underflow(
    stats: GradientStats,
    *,
    step: int,
    compute: torch.dtype,
    scales: bool,
    loss_scale: float | None,
    fp16_in_use: bool,
    zero_threshold: float,
    underflow_threshold: float,
    zero_breakdown: ZeroBreakdown | None = None,
    output_grads: GradientStats | None = None,
    reference: str = "",
) -> Finding | None:
    """Gradients lost below fp16's range (fp16 compute: exact zeros), or that would be.

    In fp16-compute runs the lost gradients are exact zeros. With `zero_breakdown`
    (an fp32 replay of the step) only lost zeros count, as a share of the elements
    the replay keeps: zeros whose fp32 gradient is non-zero, and zeros behind
    output elements whose gradient looks flushed in its cast to fp16
    (`output_grads`: all zero, or zeros beside subnormals). Structural zeros (zero
    in fp32 whatever the outputs' gradient) never count. Without a split, or when
    the replay is not faithful (more than `UNFAITHFUL_REPLAY_SHARE` of the
    elements non-zero in the run but zero in the replay), the share of all zeros
    is reported as information only: it cannot tell underflow from structure.

    Args:
        stats: the sampled gradients against fp16's range.
        step: the step they belong to.
        compute: the run's effective compute dtype.
        scales: whether the loss is scaled.
        loss_scale: the step's loss scale.
        fp16_in_use: fp16 parameters or reduction (a non-fp16-compute run then
            really loses these values: warning instead of info).
        zero_threshold: share of lost (or, unsplit, of all) zeros reported in
            fp16-compute runs.
        underflow_threshold: share below the smallest subnormal reported otherwise.
        zero_breakdown: the zeros split by an fp32 replay of the step.
        output_grads: the recorded gradients of the model's fp16 outputs against
            fp16's range (with `zero_breakdown`).
        reference: ``FP32_REPLAY``, or why there is no split.
    """
    if stats.elements == 0:
        return None
    fp16 = format_info(torch.float16)
    evidence: dict[str, Any] = {
        "step": step,
        "compute_dtype": dtype_name(compute),
        "loss_scaling": scales,
        "loss_scale": loss_scale,
        **stats.to_dict(),
        "fp16_smallest_subnormal": fp16.smallest_subnormal,
        "fp16_smallest_normal": fp16.smallest_normal,
        "fp16_max": fp16.max,
    }
    remedy = (
        "raise LossScaling.init_scale or growth, or compute in bf16 (preset amp_bf16)"
        if scales
        else "scale the loss (preset amp_fp16: dynamic loss scaling) or compute in bf16 "
        "(preset amp_bf16)"
    )
    severity: Severity
    if compute == torch.float16:
        split = zero_breakdown
        if (
            split is not None
            and split.reference_only_zero > UNFAITHFUL_REPLAY_SHARE * split.elements
        ):
            reference = (
                f"the fp32 replay is not the same step: {split.reference_only_zero} elements "
                "non-zero in the run are zero in the replay (a forward that depends on more "
                "than its inputs, parameters, buffers and the RNG?)"
            )
            evidence["unfaithful_replay"] = split.to_dict()
            split = None
        evidence["reference"] = reference if split is None else FP32_REPLAY
        if split is not None:
            flushed = _flushed_at_outputs(output_grads)
            lost = split.underflow + (split.at_outputs if flushed else 0)
            kept = split.reference_nonzero + (split.at_outputs if flushed else 0)
            frac = lost / kept if kept else 0.0
            if frac < zero_threshold:
                return None
            evidence.update(
                fraction=frac,
                threshold=zero_threshold,
                underflow_zeros=split.underflow,
                structural_zeros=split.structural,
                at_output_zeros=split.at_outputs,
                output_gradient_flushed=flushed,
                output_gradient=None if output_grads is None else output_grads.to_dict(),
                unsplit_zeros=stats.zeros - split.zeros,
                reference_nonzero=split.reference_nonzero,
                reference_only_zero=split.reference_only_zero,
                underflow_zero_fraction=frac,
                largest_lost_gradient=split.largest_lost,
            )
            message = _split_message(
                split, output_grads, flushed=flushed, frac=frac, step=step, scales=scales
            )
            fix = f"the loss scale is too low for these gradients: {remedy}" if scales else remedy
            severity = "warning" if scales else "error"
        else:
            frac = stats.zero_fraction
            if frac < zero_threshold:
                return None
            evidence.update(fraction=frac, threshold=zero_threshold)
            message = (
                f"{frac:.1%} of gradient elements were exactly zero at step {step} under fp16 "
                f"compute{'' if scales else ' without loss scaling'}: underflow below fp16's "
                f"smallest subnormal ({fp16.smallest_subnormal:.3g}) or structural zeros "
                "(always-zero inputs, inactive units), which an fp32 replay of the step tells "
                f"apart, but there is none: {reference}"
            )
            fix = (
                "let the probe replay a sampled step in fp32: give it the model and attach "
                "it before the first step (probe.attach(prec, model)); if they are "
                f"underflow, {remedy}"
            )
            severity = "info"
    else:
        frac = stats.underflow_fraction
        if frac < underflow_threshold:
            return None
        evidence.update(fraction=frac, threshold=underflow_threshold)
        message = (
            f"{frac:.1%} of gradient elements at step {step} are below fp16's smallest "
            f"subnormal ({fp16.smallest_subnormal:.3g}) and {stats.flush_fraction:.1%} "
            "below its smallest normal: cast to fp16 (fp16 compute, storage or "
            "reduction) they would be lost"
        )
        fix = (
            "keep these gradients in bf16/fp32; if you move to fp16, use dynamic loss "
            "scaling (preset amp_fp16)"
        )
        severity = "warning" if fp16_in_use else "info"
    return Finding(
        rule="gradient-underflow",
        severity=severity,
        where=f"gradients at step {step}",
        message=message,
        evidence=evidence,
        fix=fix,
    )


def vanishing_updates(
    updates: UpdateStats,
    *,
    step: int,
    where: str,
    dtype: torch.dtype,
    worst_fraction: float,
    param_dtypes: list[str],
    master_updates: UpdateStats | None,
    threshold: float,
    optimizer: str = "torch.optim.AdamW",
) -> Finding | None:
    """Non-zero updates that left 16-bit parameters (without a master) unchanged.

    Args:
        updates: intended and vanished elements over the masterless 16-bit params.
        step: the sampled step.
        where: the name of the worst parameter.
        dtype: its dtype.
        worst_fraction: its vanished share.
        param_dtypes: dtypes of the parameters measured.
        master_updates: the same count for parameters with a master (evidence only).
        threshold: the share that is reported.
        optimizer: the name of the optimizer that stepped the worst parameter
            (``torch.optim.SGD``): the fix names the master for it.
    """
    frac = updates.fraction
    if updates.intended == 0 or frac < threshold:
        return None
    info = format_info(dtype)
    name = dtype_name(dtype)
    evidence: dict[str, Any] = {
        "step": step,
        **updates.to_dict(),
        "param_dtypes": param_dtypes,
        "worst_parameter": where,
        "worst_parameter_fraction": worst_fraction,
        "lost_update_below_at_1": info.min_update_at_one,
        "threshold": threshold,
    }
    if master_updates is not None:
        evidence["with_master"] = master_updates.to_dict()
    return Finding(
        rule="vanishing-updates",
        severity="error" if frac >= 0.5 else "warning",
        where=where,
        message=(
            f"{frac:.1%} of the non-zero updates at step {step} left {name} parameters "
            f"unchanged ({updates.vanished} of {updates.intended} elements): an update "
            f"smaller than half a {name} ulp of its weight (under {info.min_update_at_one:.3g} "
            "of a weight near 1) rounds back to the old value"
        ),
        evidence=evidence,
        fix=(
            f"keep a master: {master_fix(optimizer)}; or store these parameters in fp32 "
            "(a larger learning rate only hides it)"
        ),
    )


def loss_scale_collapse(
    verdict: ScaleVerdict,
    *,
    step: int,
    consecutive_skips: int,
    skipped_steps: int,
    recent_scales: list[list[float]],
) -> Finding:
    """The dynamic loss scale collapsed (see `mixprec.doctor.runtime.measure.judge_loss_scale`),
    saying where the overflow was seen: in backward when the skipped steps' losses
    were finite, in the forward pass or the loss when they were not."""
    finite, nonfinite = verdict.skipped_with_finite_loss, verdict.skipped_with_nonfinite_loss
    forward_fix = (
        "find what overflows (Probe(model=...) names the first module with inf output: "
        "nonfinite-source) and keep it in fp32 (Policy.fp32_modules), lower the learning "
        "rate, or compute in bf16 (no loss scaling needed)"
    )
    if finite and not nonfinite:
        where = (
            f"the loss was finite on all {finite} of them, so the overflow is in the "
            "backward pass: a gradient passes fp16's max at any scale"
        )
        fix = (
            "scale the loss down (a mean rather than a sum, a smaller multiplier: the "
            "gradient of a large loss is large in every layer), keep the layers the "
            "gradient overflows in fp32 (Policy.fp32_modules), or compute in bf16 (no loss "
            "scaling needed)"
        )
    elif nonfinite and not finite:
        where = (
            f"the loss was inf/NaN on all {nonfinite} of them, so the forward pass or the "
            "loss overflows fp16 at any scale"
        )
        fix = forward_fix
    elif finite and nonfinite:
        where = (
            f"the loss was inf/NaN on {nonfinite} of them (forward pass or loss) and finite "
            f"on {finite} (there the overflow is in backward)"
        )
        fix = forward_fix
    else:  # the losses did not go through prec.backward
        where = "something overflows fp16 at any scale"
        fix = forward_fix
    return Finding(
        rule="loss-scale-collapse",
        severity="error",
        where=f"loss scale at step {step}",
        message=(
            f"the loss scale fell from {verdict.init_scale:g} to {verdict.current_scale:g} "
            f"({verdict.octaves_below_init:.0f} halvings) with {verdict.skipped_in_window} of "
            f"the last {verdict.window_steps} steps skipped: {where}, so steps keep being "
            "skipped"
        ),
        evidence={
            "step": step,
            **verdict.to_dict(),
            "consecutive_skips": consecutive_skips,
            "skipped_steps": skipped_steps,
            "recent_scales": recent_scales,
        },
        fix=fix,
    )


def clip_before_unscale(
    change: ScaledGradientChange, *, step: int, loss_scale: float | None
) -> Finding:
    """Gradients changed in place while they still carried the loss scale (a clip before
    the unscale, most likely).

    Evidence: ``caller``, ``step``, ``loss_scale``, ``grad_norm`` (the true norm
    the gradients were left with) and, when finite, ``scaled_grad_norm``
    (``grad_norm * loss_scale``: a norm clip that engaged leaves its ``max_norm`` here).
    """
    evidence: dict[str, Any] = {
        "caller": change.caller,
        "step": step,
        "loss_scale": loss_scale,
        "grad_norm": change.grad_norm,
    }
    scale = "unknown" if loss_scale is None else f"{loss_scale:g}"
    left = ""
    if loss_scale and math.isfinite(change.grad_norm):
        scaled = change.grad_norm * loss_scale
        evidence["scaled_grad_norm"] = scaled
        left = (
            f" (the gradients were left with a scaled norm of {scaled:.3g}, the max_norm of a "
            f"norm clip that engaged, which is a true norm of {change.grad_norm:.3g})"
        )
    return Finding(
        rule="clip-before-unscale",
        severity="error",
        where=change.caller,
        message=(
            f"the gradients were changed in place after prec.backward, while still multiplied "
            f"by the loss scale ({scale}), before step {step}: a clip there "
            "(torch.nn.utils.clip_grad_norm_ or clip_grad_value_) applies its threshold to "
            f"scaled gradients, so clipping is effectively far tighter than asked{left}"
        ),
        evidence=evidence,
        fix=(
            "clip with prec.clip_grad_norm_(params, max_norm) (it unscales first), or call "
            "prec.unscale_(optimizer) (scaler.unscale_ in plain AMP) before "
            "torch.nn.utils.clip_grad_norm_"
        ),
    )


def grad_accum_16bit(
    *,
    step: int,
    backwards: int,
    grad_dtype: torch.dtype,
    relative_error: float,
    one_rounding_error: float,
    params: int,
    policy: str,
) -> Finding:
    """The gradients of 16-bit parameters were summed in their own dtype over several
    backward passes of one step (gradient accumulation without ``grad_accum_dtype``).

    Evidence: ``step``, ``backwards`` (the most backward passes one gradient summed),
    ``grad_dtype``, ``relative_error`` (the 2-norm of ``.grad`` minus the fp32 sum of the
    same gradients, over that sum's norm, across the 16-bit parameters that accumulated),
    ``fp32_accumulation_error`` (what rounding that fp32 sum once to ``grad_dtype``, as
    ``grad_accum_dtype: fp32`` does, leaves) and ``params``.
    """
    name = dtype_name(grad_dtype)
    return Finding(
        rule="grad-accum-16bit",
        severity="warning",
        where=f"policy {policy!r} (grad_accum_dtype)",
        message=(
            f"the gradients of {params} {name} parameters were summed in {name} .grad over "
            f"{backwards} backward passes before step {step}, rounded at every one: they are "
            f"{relative_error:.3%} off the fp32 sum of the same gradients (2-norm, relative), "
            f"where an fp32 sum rounded once would be {one_rounding_error:.3%} off; the error "
            "grows with the number of micro-batches"
        ),
        evidence={
            "step": step,
            "backwards": backwards,
            "grad_dtype": name,
            "relative_error": relative_error,
            "fp32_accumulation_error": one_rounding_error,
            "params": params,
        },
        fix=(
            "set grad_accum_dtype: fp32 in the policy (Policy.replace(grad_accum_dtype="
            "torch.float32)): the gradients are summed in fp32 and rounded once, for 4 bytes "
            "per 16-bit parameter while a step accumulates"
        ),
    )


def nonfinite_source(
    hit: NonfiniteHit, *, step: int, first_nonfinite_step: int | None, compute: torch.dtype
) -> Finding:
    """The first module whose forward output turned inf/NaN."""
    fp16 = format_info(torch.float16)
    if hit.inputs_finite:
        message = (
            f"'{hit.module}' ({hit.module_type}) is the first module whose forward output "
            f"turned {'NaN' if hit.has_nan else 'inf'} ({hit.nonfinite_elements} elements, "
            f"{hit.output_dtype}) at step {step}, from finite inputs: it produces the "
            "non-finite values"
        )
        fix = (
            f"keep '{hit.module}' in fp32 (Policy.fp32_modules) if it overflows 16 bits "
            f"(fp16 max {fp16.max:g}), or fix what it computes (division by ~0, log of 0, "
            "exp overflow) or its weights"
        )
    else:
        message = (
            f"'{hit.module}' ({hit.module_type}) is the first module with a non-finite output "
            f"at step {step}, but its inputs were already non-finite: the data or what feeds "
            "the model carries inf/NaN"
        )
        fix = "check the input batch and any preprocessing for inf/NaN"
    return Finding(
        rule="nonfinite-source",
        severity="error",
        where=hit.module,
        message=message,
        evidence={
            "module": hit.module,
            "module_type": hit.module_type,
            "inputs_finite": hit.inputs_finite,
            "nonfinite_elements": hit.nonfinite_elements,
            "has_nan": hit.has_nan,
            "output_dtype": hit.output_dtype,
            "found_at_step": step,
            "first_nonfinite_step": first_nonfinite_step,
            "compute_dtype": dtype_name(compute),
        },
        fix=fix,
    )


def nonfinite_not_in_forward(*, first_nonfinite_step: int | None, steps_watched: int) -> Finding:
    """Non-finite gradients whose source is not a forward output (loss or backward)."""
    return Finding(
        rule="nonfinite-source",
        severity="info",
        where="backward pass or loss",
        message=(
            f"gradients turned non-finite at step {first_nonfinite_step}, but every module's "
            f"forward output stayed finite over the {steps_watched} steps watched: the inf/NaN "
            "arises in the loss or in backward"
        ),
        evidence={"first_nonfinite_step": first_nonfinite_step, "steps_watched": steps_watched},
        fix="check the loss (log of 0, division by a zero count) and custom backward code",
    )
