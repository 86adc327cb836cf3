"""Requested versus effective precision on a device: refuse, warn, or report.

mixprec never swaps formats behind the user's back: a compute dtype the device
cannot run is an error (`check_compute`), one it runs slowly is a
`PerformanceWarning` (`warn_if_slow`), and `effective_precision` reports both
as plain data (what `Precision.describe` returns and run records keep), with
the plan and the fp32 island modules; `summary_text` says it in a few lines.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.device import device_caps
from mixprec.dtypes import dtype_name
from mixprec.engine.fp8 import Float8Conversion
from mixprec.engine.plan import PrecisionPlan
from mixprec.errors import PerformanceWarning, PrecisionError, user_stacklevel
from mixprec.policy import Policy

__all__ = ["check_compute", "effective_precision", "summary_text", "warn_if_slow"]


def check_compute(plan: PrecisionPlan, device: torch.device) -> None:
    """Raise `PrecisionError` if `device` cannot compute in the plan's autocast dtype."""
    compute = plan.autocast_dtype
    if compute is None:
        return
    caps = device_caps(device)
    if not caps.supported(compute):
        raise PrecisionError(
            f"policy {plan.policy_name!r} asks for {dtype_name(compute)} compute, "
            f"which {caps.name} cannot run: {caps.reason(compute)}; mixprec does not swap "
            "formats silently: choose another policy (e.g. 'auto')"
        )


def warn_if_slow(plan: PrecisionPlan, device: torch.device) -> None:
    """Warn (`PerformanceWarning`) when `device` runs the autocast dtype unaccelerated."""
    compute = plan.autocast_dtype
    if compute is None:
        return
    caps = device_caps(device)
    if not caps.fast(compute):
        warnings.warn(
            f"{dtype_name(compute)} compute is not accelerated on {caps.name}: "
            f"{caps.reason(compute)}; the run is correct but may be slower than fp32",
            PerformanceWarning,
            stacklevel=user_stacklevel(),
        )


def effective_precision(
    policy: Policy,
    plan: PrecisionPlan,
    device: torch.device,
    islands: tuple[str, ...] | None,
    fp8: Float8Conversion | None = None,
) -> dict[str, Any]:
    """Requested versus effective precision on `device`, as plain data (the keys are
    listed by `Precision.describe`)."""
    compute = plan.autocast_dtype
    caps = device_caps(device)
    return {
        "policy": policy.to_dict(),
        "plan": plan.to_dict(),
        "fp32_islands": None if islands is None else list(islands),
        "fp8": None if fp8 is None else fp8.to_dict(),
        "device": str(device),
        "device_name": caps.name,
        "compute_supported": True if compute is None else caps.supported(compute),
        "compute_fast": True if compute is None else caps.fast(compute),
        "reason": "" if compute is None else caps.reason(compute),
    }


def summary_text(
    policy: Policy,
    plan: PrecisionPlan,
    effective: dict[str, Any],
    fp8: Float8Conversion | None = None,
) -> str:
    """A few lines of text from `effective_precision` output: the policy, the device,
    the plan (`PrecisionPlan.describe`), the fp32 island modules and, under an FP8
    policy, the layers converted and kept (`Float8Conversion.describe`)."""
    device = f"device: {effective['device']} ({effective['device_name']})"
    if not effective["compute_fast"]:
        device += f"; {effective['reason']}"
    names = effective["fp32_islands"]
    if names is None:
        islands = "fp32 island modules: not known until prepare(model)"
    else:
        islands = f"fp32 island modules: {', '.join(n or '<model>' for n in names) or 'none'}"
    lines = [f"policy {policy.name!r}: {policy.describe()}", device, plan.describe(), islands]
    if fp8 is not None:
        lines.append(fp8.describe())
    elif plan.fp8 is not None:
        lines.append("fp8 layers: not known until prepare(model)")
    return "\n".join(lines)
