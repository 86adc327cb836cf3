"""What every trainer integration logs after a step: one home for the names.

The trainers' own loggers (HF ``report_to``, Lightning loggers, Accelerate
trackers) receive these next to the loss, so a run's skipped steps, loss scale and
the doctor's runtime findings sit in the dashboards people already read.
"""

from __future__ import annotations

from collections import Counter

from mixprec.doctor.runtime.probe import Probe
from mixprec.engine import Precision

__all__ = ["step_metrics"]


def step_metrics(prec: Precision) -> dict[str, float]:
    """``mixprec/applied_steps``, ``mixprec/skipped_steps``, ``mixprec/loss_scale`` (under
    loss scaling) and, when a `mixprec.doctor.Probe` watches `prec`
    (``probe.attach(prec)``), ``mixprec/doctor/<rule>``: how many of its findings carry
    each rule id (``probe.findings()`` has the evidence and the fix)."""
    stats = prec.stats
    out = {
        "mixprec/applied_steps": float(stats.applied_steps),
        "mixprec/skipped_steps": float(stats.skipped_steps),
    }
    if stats.loss_scale is not None:
        out["mixprec/loss_scale"] = float(stats.loss_scale)
    for observer in prec.observers:
        if isinstance(observer, Probe):
            rules = Counter(f.rule for f in observer.findings())
            for rule, count in sorted(rules.items()):
                out[f"mixprec/doctor/{rule}"] = out.get(f"mixprec/doctor/{rule}", 0.0) + count
    return out
