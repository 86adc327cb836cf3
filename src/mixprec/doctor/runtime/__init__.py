"""The doctor at run time: `Probe` and its observers, one per diagnosis.

Observers (`StepObserver`s, each a module): `GradientObserver`
(``gradient-underflow``), `UpdateObserver` (``vanishing-updates``),
`LossScaleObserver` (``loss-scale-collapse``), `ClipObserver`
(``clip-before-unscale``), `NonfiniteObserver` (``nonfinite-source``). Their
thresholds are one `ProbeThresholds`; the measurements (`measure`) and the
wording of the findings (`rules`) are pure functions.
"""

from mixprec.doctor.runtime.clipping import ClipObserver
from mixprec.doctor.runtime.gradients import GradientObserver, GradientSample
from mixprec.doctor.runtime.hunter import NonfiniteHit, NonfiniteHunter
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.loss_scale import LossScaleObserver
from mixprec.doctor.runtime.measure import (
    GradientStats,
    ScaledGradientChange,
    ScaleEntry,
    ScaleVerdict,
    UpdateStats,
    gradient_stats,
    judge_loss_scale,
    update_stats,
)
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.nonfinite import NonfiniteObserver
from mixprec.doctor.runtime.probe import DEFAULT_EVERY, Probe, ProbeSample
from mixprec.doctor.runtime.thresholds import ProbeThresholds
from mixprec.doctor.runtime.updates import UpdateObserver, UpdateSample

__all__ = [
    "DEFAULT_EVERY",
    "ClipObserver",
    "FindingLedger",
    "GradientObserver",
    "GradientSample",
    "GradientStats",
    "LossScaleObserver",
    "ModelIndex",
    "NonfiniteHit",
    "NonfiniteHunter",
    "NonfiniteObserver",
    "Probe",
    "ProbeSample",
    "ProbeThresholds",
    "ScaleEntry",
    "ScaleVerdict",
    "ScaledGradientChange",
    "UpdateObserver",
    "UpdateSample",
    "UpdateStats",
    "gradient_stats",
    "judge_loss_scale",
    "update_stats",
]
