"""Rules about what the optimizer and the model store.

16-bit optimizer state, masters over fp32 params, norm layers in 16 bits.
"""

from __future__ import annotations

from typing import Any

from mixprec.doctor.facts import FULL_PRECISION_MASTERS, TrainingFacts
from mixprec.doctor.findings import Finding, Severity
from mixprec.doctor.rules.common import (
    MASTER_EXTRA_BYTES,
    ROUNDED_MOMENTS,
    SHORT_RUN_STEPS,
    dtype_label,
    group_evidence,
)
from mixprec.doctor.rules.fixes import master_unneeded_fix, moments_fix, storage_fix
from mixprec.floats import float_format, is_16bit_name

__all__ = ["master_without_16bit_params", "norm_in_16bit", "optimizer_state_16bit"]


def optimizer_state_16bit(facts: TrainingFacts) -> list[Finding]:
    """An optimizer without a (full-precision) master over 16-bit parameters.

    Every recognised optimizer (`OptimizerFacts.state` not None): Adam's moments,
    SGD's momentum buffer, Lion's momentum, or no state at all (plain SGD, which still
    rounds each update to the parameter's format). Error for full-parameter
    training; warning when only adapters train or the run is short (at most
    `SHORT_RUN_STEPS`). With a master but 16-bit state: info.
    """
    opt = facts.optimizer
    if opt is None or opt.state is None:
        return []
    state = ", ".join(opt.state)
    kept = "is" if len(opt.state) == 1 else "are"
    half = [g for g in opt.groups if is_16bit_name(g.param_dtype)]
    lossy = [g for g in half if g.master not in FULL_PRECISION_MASTERS]
    where = facts.locate("optimizer", "param_dtype")
    base: dict[str, Any] = {
        "optimizer": opt.name,
        "state": list(opt.state),
        "param_dtype": dtype_label(half[0].param_dtype) if half else dtype_label(facts.param_dtype),
        "param_dtype_source": facts.param_dtype_note or "stated",
        "peft": facts.peft,
        "steps": facts.steps,
        "short_run_steps": SHORT_RUN_STEPS,
    }
    if opt.note:
        base["optimizer_note"] = opt.note
    if lossy:
        dt = lossy[0].param_dtype
        info = float_format(dt)
        short = facts.steps is not None and facts.steps <= SHORT_RUN_STEPS
        severity: Severity = "warning" if (facts.peft or short) else "error"
        why = []
        if facts.peft:
            why.append("only adapters train (PEFT)")
        if short:
            why.append(f"the run is short ({facts.steps} steps <= {SHORT_RUN_STEPS})")
        moments = sorted({g.moments for g in lossy})
        masters = sorted({g.master for g in lossy})
        assumed = f" ({facts.param_dtype_note})" if facts.param_dtype_note else ""
        stored = [m for m in moments if m != "none"]
        message = (
            f"{opt.name} updates {dtype_label(dt)} parameters{assumed} with no full-precision "
            f"master (master: {', '.join(masters)}): every update is rounded to "
            f"{dtype_label(dt)}, so updates below {info.min_update_at_one:.3g} of a weight are "
            "lost, "
            + (
                f"and its {state} {kept} stored in {', '.join(stored)}"
                if opt.state and stored
                else "even though it keeps no state of its own"
            )
        )
        if severity == "warning":
            message += f"; a warning rather than an error because {' and '.join(why)}"
        else:
            message += (
                "; over a long full-parameter run this silently slows or destabilizes training"
            )
        evidence = {
            **base,
            "master": masters[0] if len(masters) == 1 else masters,
            "moments": moments[0] if len(moments) == 1 else moments,
            "full_parameter_training": not facts.peft,
            "lost_update_below_at_1": info.min_update_at_one,
            "groups": group_evidence(lossy),
        }
        return [
            Finding(
                rule="optimizer-state-16bit",
                severity=severity,
                where=where,
                message=message,
                evidence=evidence,
                fix=storage_fix(facts),
            )
        ]
    coarse = [g for g in half if g.moments in ROUNDED_MOMENTS]
    if not coarse:
        return []
    moments = sorted({g.moments for g in coarse})
    return [
        Finding(
            rule="optimizer-state-16bit",
            severity="info",
            where=where,
            message=(
                f"{opt.name} keeps updates at about fp32 precision (master: "
                f"{coarse[0].master}) but stores its {state} in {', '.join(moments)}: "
                "optimizer state narrower than fp32 is usually fine, but it loses small "
                "changes of a running average (a second moment most) late in long runs"
            ),
            evidence={
                **base,
                "master": coarse[0].master,
                "moments": moments[0] if len(moments) == 1 else moments,
                "groups": group_evidence(coarse),
            },
            fix=moments_fix(facts),
        )
    ]


def master_without_16bit_params(facts: TrainingFacts) -> list[Finding]:
    """A master representation requested for fp32 parameters."""
    opt = facts.optimizer
    if opt is None:
        return []
    wasted = [g for g in opt.groups if g.param_dtype == "fp32" and g.master not in ("none", "")]
    if not wasted:
        return []
    masters = sorted({g.master for g in wasted})
    extra = max(MASTER_EXTRA_BYTES.get(m, 4) for m in masters)
    return [
        Finding(
            rule="master-without-16bit-params",
            severity="warning",
            where=facts.locate("master", "optimizer"),
            message=(
                f"master {', '.join(masters)} requested for fp32 parameters: fp32 parameters "
                f"already are the master, so this adds up to {extra} bytes per parameter for "
                "nothing"
            ),
            evidence={
                "optimizer": opt.name,
                "param_dtype": "fp32",
                "master": masters[0] if len(masters) == 1 else masters,
                "extra_bytes_per_param": extra,
                "groups": group_evidence(wasted),
            },
            fix=master_unneeded_fix(facts),
        )
    ]


def norm_in_16bit(facts: TrainingFacts) -> list[Finding]:
    """Norm layers, or the loss, in 16-bit storage/compute without an fp32 island."""
    out: list[Finding] = []
    if facts.norms_fp32 is False:
        shown = list(facts.norm_detail[:8])
        out.append(
            Finding(
                rule="norm-in-16bit",
                severity="warning",
                where=facts.locate("norms"),
                message=(
                    "norm layers hold 16-bit parameters with no fp32 island: their mean and "
                    "variance reductions and their small learned scales lose precision"
                ),
                evidence={
                    "norm_modules_16bit": shown,
                    "count": len(facts.norm_detail),
                    "param_dtype": dtype_label(facts.param_dtype),
                },
                fix=(
                    "keep norms in fp32: precision.fp32_modules with '*Norm' patterns "
                    "(mixprec's default)"
                    if facts.dialect == "mixprec"
                    else "keep norm layers in fp32 (mixprec.Precision.prepare does this by "
                    "default through Policy.fp32_modules)"
                ),
            )
        )
    if facts.loss_fp32 is False:
        out.append(
            Finding(
                rule="norm-in-16bit",
                severity="warning",
                where=facts.locate("loss"),
                message=(
                    f"the loss is computed from {dtype_label(facts.compute_dtype)} logits: the "
                    "softmax's log-sum-exp over a large vocabulary loses precision and small "
                    "probabilities underflow"
                ),
                evidence={
                    "loss_fp32": False,
                    "compute_dtype": dtype_label(facts.compute_dtype),
                },
                fix=(
                    "upcast the logits to fp32 for the loss (loss_fn.fp32_upcast: true, the "
                    "default)"
                    if facts.dialect == "nemo"
                    else "compute the loss in fp32 (logits.float())"
                ),
            )
        )
    return out
