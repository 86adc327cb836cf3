"""Pure measurements behind the runtime probes: gradient range, zeros split against an
fp32 reference, lost updates, scale trend, and the record of gradients changed while
still scaled.

These take tensors or plain numbers and return frozen records, so they are tested
against closed-form fractions on constructed tensors. Thresholds come from
`mixprec.dtypes.format_info`, never from literals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mixprec.dtypes import DtypeLike, format_info

__all__ = [
    "GradientStats",
    "ScaleEntry",
    "ScaleVerdict",
    "ScaledGradientChange",
    "UpdateStats",
    "ZeroBreakdown",
    "gradient_stats",
    "judge_loss_scale",
    "update_stats",
    "zero_breakdown",
]

_FP32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True, kw_only=True)
class GradientStats:
    """Where gradient elements fall against a 16-bit format's range (fp16 by default).

    Attributes:
        reference: the format the elements are judged against (``"fp16"``).
        elements: how many elements were looked at.
        zeros: elements exactly zero.
        underflow: non-zero elements below the format's smallest subnormal (lost or
            badly rounded if cast to it).
        flush: non-zero elements below its smallest normal (flushed to zero where
            subnormals are flushed); includes `underflow`.
        overflow: finite elements above its max (inf if cast).
        nonfinite: inf or NaN elements.
    """

    reference: str
    elements: int
    zeros: int
    underflow: int
    flush: int
    overflow: int
    nonfinite: int

    def _frac(self, count: int) -> float:
        return count / self.elements if self.elements else 0.0

    @property
    def zero_fraction(self) -> float:
        """Share of elements exactly zero."""
        return self._frac(self.zeros)

    @property
    def underflow_fraction(self) -> float:
        """Share of elements non-zero but below the smallest subnormal."""
        return self._frac(self.underflow)

    @property
    def flush_fraction(self) -> float:
        """Share of elements non-zero but below the smallest normal."""
        return self._frac(self.flush)

    @property
    def overflow_fraction(self) -> float:
        """Share of finite elements above the format's max."""
        return self._frac(self.overflow)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the fractions."""
        return {
            **asdict(self),
            "zero_fraction": self.zero_fraction,
            "underflow_fraction": self.underflow_fraction,
            "flush_fraction": self.flush_fraction,
            "overflow_fraction": self.overflow_fraction,
        }


def gradient_stats(
    grads: Iterable[torch.Tensor], *, reference: DtypeLike = torch.float16
) -> GradientStats:
    """Count zero, underflowing, subnormal-range, overflowing and non-finite elements.

    Elements are compared in fp32 (exact for fp16/bf16/fp32 gradients) against the
    limits of `reference`; all counts are taken on device and read back once.
    """
    info = format_info(reference)
    counts: torch.Tensor | None = None
    elements = 0
    for g in grads:
        a = g.detach()
        if a.dtype != torch.float32:
            a = a.float()
        a = a.abs()
        elements += a.numel()
        # count_nonzero of a comparison avoids summing bools as int64 and isinf/isnan
        # kernels (each about 2-3x slower on CPU); `a` is |g|, so inf is a == inf and
        # NaN is what fails a <= fp32 max without being inf.
        row = torch.stack(
            [
                a.numel() - torch.count_nonzero(a),
                torch.count_nonzero(a < info.smallest_subnormal),
                torch.count_nonzero(a < info.smallest_normal),
                torch.count_nonzero(a > info.max),
                torch.count_nonzero(a == math.inf),
                a.numel() - torch.count_nonzero(a <= _FP32_MAX),
            ]
        )
        counts = row if counts is None else counts + row
    if counts is None:
        return GradientStats(
            reference=info.name,
            elements=0,
            zeros=0,
            underflow=0,
            flush=0,
            overflow=0,
            nonfinite=0,
        )
    zeros, below_sub, below_normal, above_max, inf, nonfinite = (int(v) for v in counts.tolist())
    return GradientStats(
        reference=info.name,
        elements=elements,
        zeros=zeros,
        underflow=below_sub - zeros,
        flush=below_normal - zeros,
        overflow=above_max - inf,
        nonfinite=nonfinite,
    )


@dataclass(frozen=True, kw_only=True)
class ZeroBreakdown:
    """Exactly-zero gradient elements of a run, split by an fp32 reference of the same step.

    The reference backpropagates the gradient the loss sent into the model's
    outputs, so an element can also be zero in it because that gradient was zero
    on the outputs it depends on: `at_outputs` (the zeros then lie on the loss's
    side: a loss gradient flushed in its cast to fp16 outputs, or a loss that
    ignores those outputs).

    Attributes:
        elements: elements compared (those with a reference gradient).
        zeros: of those, elements exactly zero in the run.
        structural: zero in the run and in the reference, whatever the outputs'
            gradient: no gradient reaches them (always-zero input features,
            inactive units).
        underflow: zero in the run but not in the reference: lost to the run's
            precision inside the model.
        at_outputs: zero in the run and in the reference, but reached from output
            elements whose recorded gradient is zero.
        reference_nonzero: elements non-zero in the reference (what the run could keep).
        reference_only_zero: elements non-zero in the run but zero in the reference
            (0 for a faithful reference; many mean the reference is not the same step).
        largest_lost: the largest magnitude, in the reference, of an `underflow`
            element (0.0 when none was lost).
    """

    elements: int
    zeros: int
    structural: int
    underflow: int
    at_outputs: int
    reference_nonzero: int
    reference_only_zero: int
    largest_lost: float

    @property
    def underflow_fraction(self) -> float:
        """Share of the elements non-zero in the reference that the run has at zero."""
        return self.underflow / self.reference_nonzero if self.reference_nonzero else 0.0

    @property
    def structural_fraction(self) -> float:
        """Share of the elements compared that no gradient reaches."""
        return self.structural / self.elements if self.elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the fractions."""
        return {
            **asdict(self),
            "underflow_fraction": self.underflow_fraction,
            "structural_fraction": self.structural_fraction,
        }


def zero_breakdown(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    behind_zero_outputs: Sequence[torch.Tensor | None] | None = None,
) -> ZeroBreakdown:
    """Split the exact zeros of run gradients by reference gradients of the same step.

    Args:
        pairs: ``(run, reference)`` gradients of the same parameters, same shapes
            (any floating dtypes; zeros are tested exactly, magnitudes in fp32).
        behind_zero_outputs: for each pair, the reference's gradient for a unit
            gradient on every output element whose recorded gradient is zero (None,
            or None for a pair: no such element reaches it). Where it is non-zero,
            a zero of both run and reference counts as `at_outputs`.
    """
    behind = list(behind_zero_outputs) if behind_zero_outputs is not None else []
    behind += [None] * (len(pairs) - len(behind))
    counts: torch.Tensor | None = None
    largest: torch.Tensor | None = None
    elements = 0
    for (run, ref), reach in zip(pairs, behind, strict=True):
        run_zero = run.detach() == 0
        ref_abs = ref.detach().float().abs()
        ref_zero = ref_abs == 0
        both = run_zero & ref_zero
        at_out = both & (reach.detach() != 0) if reach is not None else torch.zeros_like(both)
        lost = run_zero & ~ref_zero
        elements += run.numel()
        row = torch.stack(
            [
                torch.count_nonzero(run_zero),
                torch.count_nonzero(both & ~at_out),
                torch.count_nonzero(lost),
                torch.count_nonzero(at_out),
                ref.numel() - torch.count_nonzero(ref_zero),
                torch.count_nonzero(ref_zero & ~run_zero),
            ]
        )
        counts = row if counts is None else counts + row
        # On device, read back once with the counts (no host sync per parameter).
        worst = torch.where(lost, ref_abs, 0.0).amax() if ref_abs.numel() else ref_abs.sum()
        largest = worst if largest is None else torch.maximum(largest, worst)
    if counts is None or largest is None:
        return ZeroBreakdown(
            elements=0,
            zeros=0,
            structural=0,
            underflow=0,
            at_outputs=0,
            reference_nonzero=0,
            reference_only_zero=0,
            largest_lost=0.0,
        )
    zeros, structural, underflow, at_outputs, nonzero, only_ref = (int(v) for v in counts.tolist())
    return ZeroBreakdown(
        elements=elements,
        zeros=zeros,
        structural=structural,
        underflow=underflow,
        at_outputs=at_outputs,
        reference_nonzero=nonzero,
        reference_only_zero=only_ref,
        largest_lost=float(largest),
    )


@dataclass(frozen=True, kw_only=True)
class UpdateStats:
    """Updates that were meant to change a stored value and did not.

    Attributes:
        intended: elements whose update was meant to be non-zero.
        vanished: of those, elements whose stored value did not change.
    """

    intended: int
    vanished: int

    @property
    def fraction(self) -> float:
        """``vanished / intended`` (0 when nothing was intended)."""
        return self.vanished / self.intended if self.intended else 0.0

    def __add__(self, other: UpdateStats) -> UpdateStats:
        return UpdateStats(
            intended=self.intended + other.intended, vanished=self.vanished + other.vanished
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the fraction."""
        return {"intended": self.intended, "vanished": self.vanished, "fraction": self.fraction}


def update_stats(before: torch.Tensor, after: torch.Tensor, intended: torch.Tensor) -> UpdateStats:
    """Compare stored values before and after an update.

    Args:
        before: the stored values before the step.
        after: the stored values after it.
        intended: a boolean mask of elements whose update was meant to be non-zero.
    """
    unchanged = after == before
    return UpdateStats(intended=int(intended.sum()), vanished=int((intended & unchanged).sum()))


@dataclass(frozen=True, kw_only=True)
class ScaleEntry:
    """One step of a loss-scaled run.

    Attributes:
        step: the step index.
        scale: the loss scale the step's gradients carried.
        next_scale: the scale for the next step.
        applied: whether the update was applied (False: skipped).
        loss_finite: on a skipped step, whether its loss was finite
            (`StepReport.loss_finite`: True, the overflow was in backward), else None.
    """

    step: int
    scale: float
    next_scale: float
    applied: bool
    loss_finite: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ScaleVerdict:
    """Why a loss-scale history looks collapsed.

    Attributes:
        init_scale: the first scale seen.
        current_scale: the scale now.
        octaves_below_init: ``log2(init_scale / current_scale)``.
        skipped_in_window: skipped steps among the last `window_steps`.
        window_steps: steps looked at.
        drops_since_growth: scale decreases since the last growth.
        reason: ``"far-below-initial"`` or ``"keeps-falling"``.
        skipped_with_finite_loss: skipped steps in the window whose loss was finite
            (the overflow was in backward).
        skipped_with_nonfinite_loss: skipped steps in the window whose loss was
            inf/NaN (the forward pass or the loss overflowed).
    """

    init_scale: float
    current_scale: float
    octaves_below_init: float
    skipped_in_window: int
    window_steps: int
    drops_since_growth: int
    reason: str
    skipped_with_finite_loss: int = 0
    skipped_with_nonfinite_loss: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def judge_loss_scale(
    history: Sequence[ScaleEntry],
    *,
    init_scale: float | None = None,
    window: int = 50,
    collapse_octaves: int = 12,
    falling_run: int = 8,
    min_skips: int = 3,
) -> ScaleVerdict | None:
    """A verdict when the loss scale has collapsed, else None.

    Collapsed means either the scale sits at least `collapse_octaves` binary orders
    below its initial value with at least `min_skips` skipped steps in the last
    `window` steps, or it fell at least `falling_run` times since it last grew
    with at least half of the recent steps skipped. The usual calibration of the
    first steps (a few back-offs, then steady) meets neither.

    Args:
        history: the steps, oldest first (only the last `window` are looked at).
        init_scale: the run's initial scale (default: the first entry's scale).
    """
    if not history:
        return None
    init = init_scale if init_scale is not None else history[0].scale
    current = history[-1].next_scale
    recent = list(history[-window:])
    skipped = sum(1 for e in recent if not e.applied)
    drops = 0
    for entry in reversed(recent):
        if entry.next_scale > entry.scale:
            break
        if entry.next_scale < entry.scale:
            drops += 1
    octaves = math.log2(init / current) if current > 0 else math.inf
    reason = ""
    if octaves >= collapse_octaves and skipped >= min_skips:
        reason = "far-below-initial"
    elif drops >= falling_run and 2 * skipped >= len(recent):
        reason = "keeps-falling"
    if not reason:
        return None
    return ScaleVerdict(
        init_scale=init,
        current_scale=current,
        octaves_below_init=octaves,
        skipped_in_window=skipped,
        window_steps=len(recent),
        drops_since_growth=drops,
        reason=reason,
        skipped_with_finite_loss=sum(1 for e in recent if not e.applied and e.loss_finite),
        skipped_with_nonfinite_loss=sum(
            1 for e in recent if not e.applied and e.loss_finite is False
        ),
    )


@dataclass(frozen=True, kw_only=True)
class ScaledGradientChange:
    """Gradients changed in place between ``prec.backward`` and their unscale.

    What a clip on still-scaled gradients leaves behind: `Precision` notes it
    (`Precision.gradients_changed_while_scaled`) from the gradients' version
    counters, without wrapping any function.

    Attributes:
        caller: ``"file.py:42"`` of the training-loop call that took the step
            (``prec.step``), or ``"unknown"``.
        grad_norm: the true (unscaled) total norm of the gradients after the
            change, as the step reported it; inf or NaN when non-finite. After a
            norm clip that engaged, ``grad_norm * loss_scale`` is its ``max_norm``.
    """

    caller: str
    grad_norm: float
