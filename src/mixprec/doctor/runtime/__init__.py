"""The doctor at run time: `Probe` and its observers, one per diagnosis.

Observers (`StepObserver`s, each a module): `GradientObserver`
(``gradient-underflow``, with the fp32 replay of `reference`), `UpdateObserver`
(``vanishing-updates``), `AccumulationObserver` (``grad-accum-16bit``),
`LossScaleObserver` (``loss-scale-collapse``),
`ClipObserver` (``clip-before-unscale``), `NonfiniteObserver`
(``nonfinite-source``), `Fp8Observer` (``fp8-saturation``, ``fp8-underflow``:
the casts of torchao fp8 layers, `fp8_layers`, `fp8_measure`, `fp8_rules`). Their
thresholds are one `ProbeThresholds`; which steps they sample is one
`SampleSchedule` (a step floor and a time budget); the
measurements (`measure`) and the wording of the findings (`rules`) are pure
functions.
"""

from mixprec.doctor.runtime.accumulation import AccumulationObserver
from mixprec.doctor.runtime.clipping import ClipObserver
from mixprec.doctor.runtime.fp8 import Fp8Observer
from mixprec.doctor.runtime.fp8_layers import CastPlan, Fp8Layer, fp8_layers
from mixprec.doctor.runtime.fp8_measure import (
    Fp8CastRecord,
    Fp8CastStats,
    Fp8Limits,
    Fp8TensorSample,
    cast_counts,
    current_scale,
    delayed_scale,
    fp8_limits,
)
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
    ZeroBreakdown,
    gradient_stats,
    judge_loss_scale,
    update_stats,
    zero_breakdown,
)
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.nonfinite import NonfiniteObserver
from mixprec.doctor.runtime.probe import DEFAULT_EVERY, Probe, ProbeSample
from mixprec.doctor.runtime.reference import ForwardCapture, ForwardRecorder, replay_fp32
from mixprec.doctor.runtime.schedule import DEFAULT_OVERHEAD_BUDGET, ProbeCost, SampleSchedule
from mixprec.doctor.runtime.thresholds import ProbeThresholds
from mixprec.doctor.runtime.updates import UpdateObserver, UpdateSample

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_OVERHEAD_BUDGET",
    "AccumulationObserver",
    "CastPlan",
    "ClipObserver",
    "FindingLedger",
    "ForwardCapture",
    "ForwardRecorder",
    "Fp8CastRecord",
    "Fp8CastStats",
    "Fp8Layer",
    "Fp8Limits",
    "Fp8Observer",
    "Fp8TensorSample",
    "GradientObserver",
    "GradientSample",
    "GradientStats",
    "LossScaleObserver",
    "ModelIndex",
    "NonfiniteHit",
    "NonfiniteHunter",
    "NonfiniteObserver",
    "Probe",
    "ProbeCost",
    "ProbeSample",
    "ProbeThresholds",
    "SampleSchedule",
    "ScaleEntry",
    "ScaleVerdict",
    "ScaledGradientChange",
    "UpdateObserver",
    "UpdateSample",
    "UpdateStats",
    "ZeroBreakdown",
    "cast_counts",
    "current_scale",
    "delayed_scale",
    "fp8_layers",
    "fp8_limits",
    "gradient_stats",
    "judge_loss_scale",
    "replay_fp32",
    "update_stats",
    "zero_breakdown",
]
