"""The static rules: pure functions from `TrainingFacts` to findings.

Each rule looks only at the facts it needs and stays silent when one of them is
unknown. Numbers in messages and evidence come from `mixprec.dtypes.format_info`,
never from literals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.doctor.facts import FULL_PRECISION_MASTERS, GroupFacts, TrainingFacts
from mixprec.doctor.findings import Finding, Severity
from mixprec.dtypes import dtype_name, format_info, is_16bit, is_fp8
from mixprec.formats import master_specs, moment_specs

__all__ = [
    "MASTER_EXTRA_BYTES",
    "SHORT_RUN_STEPS",
    "STATIC_RULE_FUNCTIONS",
    "format_not_accelerated",
    "fp8_without_scaling",
    "fp16_without_loss_scaling",
    "loss_scaling_unneeded",
    "master_without_16bit_params",
    "norm_in_16bit",
    "optimizer_state_16bit",
    "reduce_dtype_16bit",
    "run_static_rules",
]

#: A run of at most this many optimizer steps counts as short: bf16 Adam state then
#: gets a warning instead of an error (the damage compounds with the step count).
SHORT_RUN_STEPS = 1000

#: Extra bytes per parameter each master representation costs (beyond the params):
#: mixprec's formats from the registry, plus the 16-bit scaled master of Transformer
#: Engine that configs of other tools can name.
MASTER_EXTRA_BYTES: dict[str, int] = {
    **{spec.name: spec.bytes_per_element for spec in master_specs()},
    "fp16": 2,
}

#: Moment formats whose elements are rounded to a narrow float every step, so small
#: moving-average increments are lost: mixprec's from the registry, plus the ones
#: other tools' configs can name (fp16, fp8, int4 without block scales).
_16BIT_MOMENTS = frozenset(
    {spec.name for spec in moment_specs() if spec.rounds_increments} | {"fp16", "fp8", "int4"}
)


def _name(dtype: torch.dtype | None) -> str:
    return dtype_name(dtype)


def _group_evidence(groups: list[GroupFacts]) -> list[dict[str, Any]]:
    return [
        {
            "group": g.label,
            "param_dtype": _name(g.param_dtype),
            "master": g.master,
            "moments": g.moments,
            "numel": g.numel,
        }
        for g in groups
    ]


def _storage_fix(facts: TrainingFacts) -> str:
    if facts.dialect == "nemo":
        return (
            "keep bf16 storage with a master: optimizer._target_: "
            "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam with master_weights: "
            "true, store_param_remainders: true, exp_avg_dtype: torch.float32, "
            "exp_avg_sq_dtype: torch.float32; or store parameters in fp32 (model.torch_dtype: "
            "float32) and compute in bf16 through distributed.mp_policy.param_dtype: bfloat16"
        )
    if facts.dialect == "mixprec":
        return (
            "use precision preset bf16_master (bf16 storage, master: exact = bitwise fp32 for "
            "2 extra bytes/param, moments: fp32) with optimizer mixprec.optim.AdamW, or keep "
            "parameters in fp32 (preset amp_bf16)"
        )
    return (
        "optimize with mixprec.optim.AdamW(params, master='exact', moments='fp32') (what "
        "Precision('bf16_master').optimizer(model) builds), or keep the parameters in fp32 "
        "and compute in bf16 under autocast (Precision('amp_bf16'))"
    )


def optimizer_state_16bit(facts: TrainingFacts) -> list[Finding]:
    """Adam-family optimizer without a (full-precision) master over 16-bit parameters.

    Error for full-parameter training; warning when only adapters train or the run
    is short (at most `SHORT_RUN_STEPS`). With a master but 16-bit moments: info.
    """
    opt = facts.optimizer
    if opt is None or not opt.adam_like:
        return []
    half = [g for g in opt.groups if is_16bit(g.param_dtype)]
    lossy = [g for g in half if g.master not in FULL_PRECISION_MASTERS]
    where = facts.locate("optimizer", "param_dtype")
    base: dict[str, Any] = {
        "optimizer": opt.name,
        "param_dtype": _name(half[0].param_dtype) if half else _name(facts.param_dtype),
        "param_dtype_source": facts.param_dtype_note or "stated",
        "peft": facts.peft,
        "steps": facts.steps,
        "short_run_steps": SHORT_RUN_STEPS,
    }
    if opt.note:
        base["optimizer_note"] = opt.note
    if lossy:
        dt = lossy[0].param_dtype
        info = format_info(dt)
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
        message = (
            f"{opt.name} updates {_name(dt)} parameters{assumed} with no full-precision "
            f"master (master: {', '.join(masters)}): every update is rounded to "
            f"{_name(dt)}, so updates below {info.min_update_at_one:.3g} of a weight are "
            f"lost, and its moments are stored in {', '.join(moments)}"
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
            "groups": _group_evidence(lossy),
        }
        return [
            Finding(
                rule="optimizer-state-16bit",
                severity=severity,
                where=where,
                message=message,
                evidence=evidence,
                fix=_storage_fix(facts),
            )
        ]
    coarse = [g for g in half if g.moments in _16BIT_MOMENTS]
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
                f"{coarse[0].master}) but stores its moments in {', '.join(moments)}: "
                "16-bit moments are "
                "usually fine, but they lose small changes of the second moment late in long "
                "runs"
            ),
            evidence={
                **base,
                "master": coarse[0].master,
                "moments": moments[0] if len(moments) == 1 else moments,
                "groups": _group_evidence(coarse),
            },
            fix="store the moments in fp32 (or int8 blockwise) if the loss plateaus early",
        )
    ]


def fp16_without_loss_scaling(facts: TrainingFacts) -> list[Finding]:
    """fp16 compute with no loss scaling: gradients below fp16's range become 0."""
    if facts.compute_dtype != torch.float16 or facts.loss_scaling is not False:
        return []
    info = format_info(torch.float16)
    severity: Severity = "warning" if facts.unscaled_acknowledged else "error"
    if facts.dialect == "nemo":
        fix = (
            "compute in bf16 (distributed.mp_policy.param_dtype: bfloat16), which has fp32's "
            "range and needs no scaling; this recipe declares no loss scaler"
        )
    elif facts.dialect == "mixprec":
        fix = "use preset amp_fp16 (dynamic loss scaling) or compute in bf16 (amp_bf16)"
    else:
        fix = (
            "scale the loss: Precision('amp_fp16') or torch.amp.GradScaler; or compute in bf16 "
            "(Precision('amp_bf16'))"
        )
    message = (
        "fp16 compute without loss scaling: gradient values below "
        f"{info.smallest_subnormal:.3g} flush to zero and those below "
        f"{info.smallest_normal:.3g} lose precision"
    )
    if facts.unscaled_acknowledged:
        message += " (explicitly allowed, e.g. for an underflow experiment)"
    return [
        Finding(
            rule="fp16-without-loss-scaling",
            severity=severity,
            where=facts.locate("compute_dtype", "loss_scaling"),
            message=message,
            evidence={
                "compute_dtype": "fp16",
                "loss_scaling": False,
                "acknowledged": facts.unscaled_acknowledged,
                "fp16_smallest_subnormal": info.smallest_subnormal,
                "fp16_smallest_normal": info.smallest_normal,
            },
            fix=fix,
        )
    ]


def loss_scaling_unneeded(facts: TrainingFacts) -> list[Finding]:
    """A loss scaler with bf16 or fp32 compute (same exponent range as fp32)."""
    if facts.loss_scaling is not True or facts.compute_dtype is None:
        return []
    if facts.compute_dtype == torch.float16:
        return []
    info = format_info(facts.compute_dtype)
    fp32 = format_info(torch.float32)
    return [
        Finding(
            rule="loss-scaling-unneeded",
            severity="info",
            where=facts.locate("loss_scaling", "compute_dtype"),
            message=(
                f"loss scaling with {_name(facts.compute_dtype)} compute: "
                f"{_name(facts.compute_dtype)} spans fp32's range (smallest normal "
                f"{info.smallest_normal:.3g}), so scaling only costs a multiply, an unscale "
                "and an inf check per step, and skips steps for nothing on overflow"
            ),
            evidence={
                "compute_dtype": _name(facts.compute_dtype),
                "loss_scaling": True,
                "compute_smallest_normal": info.smallest_normal,
                "fp32_smallest_normal": fp32.smallest_normal,
            },
            fix=(
                "drop the scaler (loss_scaling: null; torch.amp.GradScaler(enabled=False))"
                if facts.dialect != "nemo"
                else "drop the loss scaler"
            ),
        )
    ]


def reduce_dtype_16bit(facts: TrainingFacts) -> list[Finding]:
    """Gradient reduction across ranks in bf16/fp16."""
    if facts.reduce_dtype is None or not is_16bit(facts.reduce_dtype):
        return []
    info = format_info(facts.reduce_dtype)
    if facts.dialect == "nemo":
        fix = (
            "reduce in fp32: distributed.mp_policy.reduce_dtype: float32 (FSDP2), or "
            "grad_reduce_in_fp32: true (Megatron FSDP)"
        )
    elif facts.dialect == "mixprec":
        fix = "set distributed.reduce_dtype: fp32 (mixprec's default)"
    else:
        fix = "use a policy with reduce_dtype=torch.float32 (mixprec's default)"
    return [
        Finding(
            rule="reduce-dtype-16bit",
            severity="warning",
            where=facts.locate("reduce_dtype"),
            message=(
                f"gradients are summed across ranks in {_name(facts.reduce_dtype)}"
                + (f" ({facts.reduce_note})" if facts.reduce_note else "")
                + f": each addition rounds to {info.mantissa_bits} mantissa bits, so with many "
                "ranks small contributions are lost and the error grows with the world size"
            ),
            evidence={
                "reduce_dtype": _name(facts.reduce_dtype),
                "reduce_dtype_source": facts.reduce_note or "stated",
                "eps": info.eps,
            },
            fix=fix,
        )
    ]


def master_without_16bit_params(facts: TrainingFacts) -> list[Finding]:
    """A master representation requested for fp32 parameters."""
    opt = facts.optimizer
    if opt is None:
        return []
    wasted = [
        g for g in opt.groups if g.param_dtype == torch.float32 and g.master not in ("none", "")
    ]
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
                "groups": _group_evidence(wasted),
            },
            fix=(
                "drop the master (master: none; master_weights: false), or store the "
                "parameters in bf16 if memory is the goal"
            ),
        )
    ]


def format_not_accelerated(facts: TrainingFacts) -> list[Finding]:
    """The effective compute format is emulated or unsupported on the target device."""
    caps = facts.device
    dt = facts.compute_dtype
    if caps is None or dt is None or not is_16bit(dt):
        return []
    supported, fast = caps.supported(dt), caps.fast(dt)
    if supported and fast:
        return []
    better = next(
        (d for d in (torch.bfloat16, torch.float16) if caps.supported(d) and caps.fast(d)), None
    )
    effective = "not supported" if not supported else "emulated (slower than fp32)"
    fix = (
        f"compute in {_name(better)}, which is accelerated on {caps.name}"
        if better is not None
        else "compute in fp32 here (preset 'auto' picks the fastest correct format)"
    )
    return [
        Finding(
            rule="format-not-accelerated",
            severity="error" if not supported else "warning",
            where=facts.locate("compute_dtype", "device"),
            message=(
                f"{_name(dt)} compute requested on {caps.name}, where it is {effective}: "
                f"{caps.reason(dt)}"
            ),
            evidence={
                "requested": _name(dt),
                "effective": effective,
                "device": caps.device_type,
                "device_name": caps.name,
                "supported": supported,
                "fast": fast,
                "reason": caps.reason(dt),
            },
            fix=fix,
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
                    "param_dtype": _name(facts.param_dtype),
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
                    f"the loss is computed from {_name(facts.compute_dtype)} logits: the "
                    "softmax's log-sum-exp over a large vocabulary loses precision and small "
                    "probabilities underflow"
                ),
                evidence={
                    "loss_fp32": False,
                    "compute_dtype": _name(facts.compute_dtype),
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


def fp8_without_scaling(facts: TrainingFacts) -> list[Finding]:
    """fp8 values (compute or storage) without a scaling recipe."""
    raw_fp8 = facts.param_dtype is not None and is_fp8(facts.param_dtype)
    if not (raw_fp8 or (facts.fp8_enabled and facts.fp8_scaling is None)):
        return []
    dt = facts.param_dtype if raw_fp8 and facts.param_dtype is not None else torch.float8_e4m3fn
    info = format_info(dt)
    return [
        Finding(
            rule="fp8-without-scaling",
            severity="error",
            where=facts.locate("fp8", "param_dtype"),
            message=(
                f"fp8 without a scaling recipe ({facts.fp8_detail or _name(dt)}): {_name(dt)} "
                f"spans only {info.smallest_subnormal:.3g} to {info.max:g}, so unscaled weights, "
                "activations and gradients overflow or flush to zero"
            ),
            evidence={
                "fp8_format": _name(dt),
                "scaling": facts.fp8_scaling,
                "detail": facts.fp8_detail,
                "fp8_max": info.max,
                "fp8_smallest_subnormal": info.smallest_subnormal,
            },
            fix=(
                "use fp8 through a scaled recipe (torchao float8 'tensorwise'/'rowwise', "
                "Transformer Engine recipes) and keep parameters in bf16/fp32"
            ),
        )
    ]


#: The static rules, in documentation order.
STATIC_RULE_FUNCTIONS: tuple[Callable[[TrainingFacts], list[Finding]], ...] = (
    optimizer_state_16bit,
    fp16_without_loss_scaling,
    loss_scaling_unneeded,
    reduce_dtype_16bit,
    master_without_16bit_params,
    format_not_accelerated,
    norm_in_16bit,
    fp8_without_scaling,
)


def run_static_rules(facts: TrainingFacts) -> list[Finding]:
    """Every static rule's findings for `facts`."""
    return [f for rule in STATIC_RULE_FUNCTIONS for f in rule(facts)]
