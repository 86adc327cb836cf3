"""The fp8 runtime rules: pure functions from sampled fp8 tensors to findings.

``fp8-saturation``: casts that clip at the fp8 format's max, measured under the
layer's own scaling (torchao's current scaling: none by construction) or, as a
what-if, under Transformer Engine's delayed scaling from the amax history.
``fp8-underflow``: non-zero elements the measured casts flush to zero.
``format-not-accelerated`` (the static rule's id): fp8 layers emulated, or on a
device without FP8 units.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mixprec.doctor.findings import Finding, Severity
from mixprec.doctor.runtime.fp8_measure import Fp8TensorSample

__all__ = [
    "DELAYED_WHAT_IF",
    "MAX_LAYERS_IN_EVIDENCE",
    "fp8_not_accelerated",
    "fp8_saturation",
    "fp8_underflow",
]

#: Evidence lists at most this many tensors, worst first.
MAX_LAYERS_IN_EVIDENCE = 20

#: How the what-if is named in evidence and messages.
DELAYED_WHAT_IF = "what-if: Transformer Engine DelayedScaling from the probe's amax history"


def _scales(t: Fp8TensorSample) -> tuple[float, float]:
    lo = min((c.stats.scale_min for c in t.casts), default=0.0)
    hi = max((c.stats.scale_max for c in t.casts), default=0.0)
    return lo, hi


def _entry(t: Fp8TensorSample) -> dict[str, Any]:
    lo, hi = _scales(t)
    return {
        "layer": t.layer,
        "role": t.role,
        "format": t.format,
        "recipe": t.recipe,
        "granularity": sorted({c.granularity for c in t.casts}),
        "saturated_fraction": t.saturated_fraction,
        "underflow_fraction": t.underflow_fraction,
        "amax": t.amax,
        "scale": lo if lo == hi else [lo, hi],
        "delayed_saturated_fraction": None if t.delayed is None else t.delayed_saturated_fraction,
        "delayed_underflow_fraction": None if t.delayed is None else t.delayed.underflow_fraction,
        "delayed_scale": t.delayed_scale,
        "amax_history": list(t.history),
        "steps_sampled": t.samples,
    }


def _what_if(history_len: int, margin: int, algo: str) -> dict[str, Any]:
    return {
        "recipe": "Transformer Engine DelayedScaling (reproduced by the probe)",
        "amax_history_len": history_len,
        "history_counts": "sampled steps, not every step",
        "amax_compute_algo": algo,
        "margin": margin,
        "scale": "fp8_max / amax / 2**margin, amax from the history before the sample",
    }


def _where(t: Fp8TensorSample) -> str:
    return f"{t.layer} ({t.role})"


def fp8_saturation(
    tensors: Sequence[Fp8TensorSample],
    *,
    step: int,
    threshold: float,
    history_len: int,
    margin: int,
    algo: str,
) -> Finding | None:
    """Tensors whose fp8 casts clip at least `threshold` of their elements.

    Measured clipping (the layer's own scaling) is a warning; clipping only under
    the delayed-scaling what-if is info: the run does not clip, a TE delayed recipe
    on the same tensors would.

    Args:
        tensors: the fp8 tensors sampled on `step`.
        step: the sampled step.
        threshold: the share of elements reported (``fp8_saturation_threshold``).
        history_len: the what-if's amax history length, in samples.
        margin: the what-if's margin.
        algo: the what-if's ``amax_compute_algo``.
    """
    measured = [t for t in tensors if t.saturated_fraction >= threshold]
    what_if = [t for t in tensors if t.delayed_saturated_fraction >= threshold]
    if not measured and not what_if:
        return None
    is_measured = bool(measured)

    def key(t: Fp8TensorSample) -> float:
        return t.saturated_fraction if is_measured else t.delayed_saturated_fraction

    hits = sorted(measured or what_if, key=key, reverse=True)
    worst = hits[0]
    frac = key(worst)
    severity: Severity = "warning" if is_measured else "info"
    if is_measured:
        message = (
            f"{len(hits)} fp8 tensor(s) clip at the format's max under their own scaling at "
            f"step {step}: worst {_where(worst)}, {frac:.2%} of its elements clipped at "
            f"{worst.format}'s max (amax {worst.amax:.3g}); clipped values lose their "
            "magnitude, a bias that no later step corrects"
        )
        fix = (
            f"exclude {worst.layer} from fp8 conversion by name (convert_to_float8_training("
            f"model, module_filter_fn=lambda mod, fqn: fqn != {worst.layer!r}), or mixprec's "
            "fp8 layer filter), or use current scaling (torchao's recipes scale each cast from "
            "its own amax), or a finer granularity (recipe 'rowwise': one scale per row)"
        )
    else:
        message = (
            f"{DELAYED_WHAT_IF}: {len(hits)} fp8 tensor(s) would clip at step {step} had their "
            f"scale come from the amax history ({algo} over the last {history_len} samples, "
            f"margin {margin}) instead of their own amax: worst {_where(worst)}, "
            f"{frac:.2%} of its elements above {worst.format}'s max (amax {worst.amax:.3g}, "
            f"largest before it {max(worst.history[:-1], default=0.0):.3g}). This run's "
            "current scaling does not clip them"
        )
        fix = (
            "keep current scaling for these layers (torchao's recipes, TE Float8CurrentScaling); "
            "with TE DelayedScaling, raise margin (each step halves the scale) or exclude "
            f"{worst.layer} from fp8 by name"
        )
    return Finding(
        rule="fp8-saturation",
        severity=severity,
        where=_where(worst),
        message=message,
        evidence={
            "step": step,
            "measured": is_measured,
            "scaling": "the layers' own (torchao current scaling)"
            if is_measured
            else DELAYED_WHAT_IF,
            "fraction": frac,
            "threshold": threshold,
            "what_if": _what_if(history_len, margin, algo),
            "tensors_over_threshold": len(hits),
            "layers": [_entry(t) for t in hits[:MAX_LAYERS_IN_EVIDENCE]],
        },
        fix=fix,
    )


def _underflow_fix(worst: Fp8TensorSample) -> str:
    """The fix for the cast that flushes the most, by its role, format and granularity."""
    exclude = (
        f"or exclude {worst.layer} from fp8 conversion by name (module_filter_fn=lambda mod, "
        f"fqn: fqn != {worst.layer!r})"
    )
    cast = max(worst.casts, key=lambda c: c.stats.underflow_fraction)
    if "grad_weight" in cast.gemms and cast.granularity == "axiswise":
        return (
            "keep the grad-weight matmul in high precision (recipe 'rowwise_with_gw_hp'): its "
            f"per-column scales span the whole batch, {exclude}"
        )
    if worst.role == "grad_output" and worst.format == "fp8_e4m3":
        return (
            "keep the gradients' grad-weight matmul in high precision (recipe "
            "'rowwise_with_gw_hp'), or cast gradients to e5m2 (recipe 'tensorwise', TE "
            f"HYBRID: 15 more binary orders below the max), {exclude}"
        )
    if cast.granularity == "tensorwise":
        return (
            "a finer granularity (recipe 'rowwise': one scale per row, so one row's outlier "
            f"no longer flushes the other rows), {exclude}"
        )
    return f"keep this tensor in high precision: {exclude}"


def fp8_underflow(
    tensors: Sequence[Fp8TensorSample], *, step: int, threshold: float
) -> Finding | None:
    """Tensors whose fp8 casts flush at least `threshold` of their non-zero elements to zero
    (measured under the layers' own scaling)."""
    hits = sorted(
        (t for t in tensors if t.underflow_fraction >= threshold),
        key=lambda t: t.underflow_fraction,
        reverse=True,
    )
    if not hits:
        return None
    worst = hits[0]
    frac = worst.underflow_fraction
    lo, _ = _scales(worst)
    return Finding(
        rule="fp8-underflow",
        severity="warning",
        where=_where(worst),
        message=(
            f"{len(hits)} fp8 tensor(s) flush non-zero values to zero at step {step}: worst "
            f"{_where(worst)}, {frac:.2%} of its non-zero elements fall at or below half "
            f"{worst.format}'s smallest subnormal once scaled (scale {lo:.3g} from amax "
            f"{worst.amax:.3g}): a wide spread of magnitudes within one scale's reach"
        ),
        evidence={
            "step": step,
            "measured": True,
            "scaling": "the layers' own (torchao current scaling)",
            "fraction": frac,
            "threshold": threshold,
            "tensors_over_threshold": len(hits),
            "layers": [_entry(t) for t in hits[:MAX_LAYERS_IN_EVIDENCE]],
        },
        fix=_underflow_fix(worst),
    )


def fp8_not_accelerated(
    *, layers: Sequence[str], emulated: Sequence[str], device: str, fp8_fast: bool, reason: str
) -> Finding | None:
    """fp8 layers whose matmuls are emulated (``emulate=True``) or on a device without FP8
    units: the run measures fp8 numerics, not fp8 speed (info)."""
    if fp8_fast and not emulated:
        return None
    why = reason if not fp8_fast else "the layers are built with Float8LinearConfig(emulate=True)"
    return Finding(
        rule="format-not-accelerated",
        severity="info",
        where=layers[0] if layers else "fp8 layers",
        message=(
            f"{len(layers)} fp8 layer(s) run emulated on {device} ({why}): emulation "
            "measures fp8 numerics (scales, saturation, underflow, loss), not fp8 speed; "
            "its step times are slower than bf16, not faster"
        ),
        evidence={
            "requested": "fp8",
            "effective": "emulated",
            "device_name": device,
            "fp8_fast": fp8_fast,
            "layers": len(layers),
            "emulate_layers": len(emulated),
            "reason": why,
        },
        fix=(
            "judge fp8 numerics here; measure fp8 speed on a GPU with FP8 units (CUDA "
            "capability 8.9+: Ada, Hopper, Blackwell) with emulate=False"
        ),
    )
