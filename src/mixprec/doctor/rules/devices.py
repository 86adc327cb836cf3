"""Rules about what the hardware does with the formats.

16-bit gradient reduction across ranks, and formats (16-bit, fp8) the device does not
accelerate.
"""

from __future__ import annotations

from mixprec.doctor.facts import TrainingFacts
from mixprec.doctor.findings import Finding
from mixprec.doctor.rules.common import (
    dtype_label,
)
from mixprec.doctor.rules.fixes import accelerated_fix, fp8_speed_fix, reduce_fix
from mixprec.doctor.rules.wrappers import wrapper_reduce_16bit
from mixprec.floats import float_format, is_16bit_name

__all__ = ["format_not_accelerated", "reduce_dtype_16bit"]


def reduce_dtype_16bit(facts: TrainingFacts) -> list[Finding]:
    """Gradient reduction across ranks in bf16/fp16: what a wrapped live model's
    wrappers do (`facts.reductions`), else what the config or policy says."""
    if facts.reductions:
        found = wrapper_reduce_16bit(facts)
        return [found] if found is not None else []
    if facts.reduce_dtype is None or not is_16bit_name(facts.reduce_dtype):
        return []
    info = float_format(facts.reduce_dtype)
    fix = reduce_fix(facts)
    return [
        Finding(
            rule="reduce-dtype-16bit",
            severity="warning",
            where=facts.locate("reduce_dtype"),
            message=(
                f"gradients are summed across ranks in {dtype_label(facts.reduce_dtype)}"
                + (f" ({facts.reduce_note})" if facts.reduce_note else "")
                + f": each addition rounds to {info.mantissa_bits} mantissa bits, so with many "
                "ranks small contributions are lost and the error grows with the world size"
            ),
            evidence={
                "reduce_dtype": dtype_label(facts.reduce_dtype),
                "reduce_dtype_source": facts.reduce_note or "stated",
                "eps": info.eps,
            },
            fix=fix,
        )
    ]


def format_not_accelerated(facts: TrainingFacts) -> list[Finding]:
    """The effective compute format is emulated or unsupported on the target device; fp8
    matmuls emulated (declared, or no FP8 units on the device)."""
    return _fp8_not_accelerated(facts) + _16bit_not_accelerated(facts)


def _fp8_not_accelerated(facts: TrainingFacts) -> list[Finding]:
    """fp8 through a scaled recipe, emulated: declared so, or a device without FP8 units
    (every CPU, CUDA capability below 8.9). Info: emulation is how fp8 numerics are
    studied without such a GPU, but its step times say nothing of fp8's speed."""
    if not facts.fp8_enabled or facts.fp8_scaling is None:
        return []  # no fp8, or unscaled fp8 (fp8-without-scaling says what matters)
    caps = facts.device
    no_units = caps is not None and not caps.fast("fp8")
    if not (facts.fp8_emulated or no_units):
        return []
    if facts.fp8_emulated:
        reason = f"emulation is asked for ({facts.fp8_emulated_by or 'emulate: true'})"
    else:
        assert caps is not None
        reason = caps.reason("fp8")
    device = caps.name if caps is not None else "the target device"
    return [
        Finding(
            rule="format-not-accelerated",
            severity="info",
            where=facts.locate("fp8_emulated", "fp8", "device"),
            message=(
                f"fp8 matmuls ({facts.fp8_scaling}) run emulated on {device}: {reason}. "
                "Emulation measures fp8 numerics (scales, saturation, underflow, loss), not "
                "fp8 speed: its steps are slower than bf16, not faster"
            ),
            evidence={
                "requested": "fp8",
                "effective": "emulated",
                "device": caps.device_type if caps is not None else None,
                "device_name": device,
                "fp8_fast": None if caps is None else caps.fast("fp8"),
                "emulate_declared": facts.fp8_emulated,
                "reason": reason,
            },
            fix=fp8_speed_fix(facts),
        )
    ]


def _compute_changed(facts: TrainingFacts) -> list[Finding]:
    """The trainer runs another compute format than the config asks for on this device
    (the HF Trainer's or Accelerate's fp16 on a CPU: no autocast; Lightning's 16-mixed on a
    CPU: bf16-mixed)."""
    caps, asked = facts.device, facts.requested_compute_dtype
    if caps is None or asked is None or not facts.compute_changed_by:
        return []
    runs = dtype_label(facts.compute_dtype) if facts.compute_dtype else "the model's own dtype"
    better = next((d for d in ("bf16", "fp16") if d != asked and caps.fast(d)), None)
    return [
        Finding(
            rule="format-not-accelerated",
            severity="warning",
            where=facts.locate("compute_dtype", "device"),
            message=(
                f"{dtype_label(asked)} compute requested on {caps.name}, where "
                f"{facts.compute_changed_by}: matmuls run in {runs}"
                + ("" if facts.loss_scaling else ", with no loss scaling")
            ),
            evidence={
                "requested": dtype_label(asked),
                "effective": runs,
                "device": caps.device_type,
                "device_name": caps.name,
                "changed_by": facts.compute_changed_by,
            },
            fix=accelerated_fix(facts, dtype_label(better) if better else None, caps.name),
        )
    ]


def _16bit_not_accelerated(facts: TrainingFacts) -> list[Finding]:
    if facts.compute_changed_by:
        return _compute_changed(facts)
    caps = facts.device
    dt = facts.compute_dtype
    if caps is None or dt is None or not is_16bit_name(dt):
        return []
    supported, fast = caps.supported(dt), caps.fast(dt)
    if supported and fast:
        return []
    better = next((d for d in ("bf16", "fp16") if caps.supported(d) and caps.fast(d)), None)
    effective = "not supported" if not supported else "emulated (slower than fp32)"
    fix = accelerated_fix(facts, dtype_label(better) if better is not None else None, caps.name)
    return [
        Finding(
            rule="format-not-accelerated",
            severity="error" if not supported else "warning",
            where=facts.locate("compute_dtype", "device"),
            message=(
                f"{dtype_label(dt)} compute requested on {caps.name}, where it is {effective}: "
                f"{caps.reason(dt)}"
            ),
            evidence={
                "requested": dtype_label(dt),
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
