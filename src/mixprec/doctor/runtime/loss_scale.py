"""``loss-scale-collapse``: a dynamic loss scale that keeps falling with skipped steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.measure import ScaleEntry, judge_loss_scale
from mixprec.doctor.runtime.rules import loss_scale_collapse
from mixprec.doctor.runtime.thresholds import ProbeThresholds

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["LossScaleObserver"]


class LossScaleObserver:
    """A `StepObserver` that follows the loss scale of every step from its `StepReport`.

    Args:
        ledger: where findings go.
        thresholds: ``window``, ``collapse_octaves``, ``falling_run`` and
            ``min_skips`` are read (see `judge_loss_scale`).
    """

    def __init__(self, *, ledger: FindingLedger, thresholds: ProbeThresholds) -> None:
        self._ledger = ledger
        self._thresholds = thresholds
        self._scales: deque[ScaleEntry] = deque(maxlen=thresholds.window)
        self._init_scale: float | None = None

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Nothing: the scale is judged from the step's report."""

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Add the step to the trend and judge it (runs without scaling are skipped)."""
        if report.scale is None or report.next_scale is None:
            return
        self._scales.append(
            ScaleEntry(
                step=report.step,
                scale=report.scale,
                next_scale=report.next_scale,
                applied=report.applied,
                loss_finite=report.loss_finite,
            )
        )
        if self._init_scale is None:
            self._init_scale = report.scale
        t = self._thresholds
        verdict = judge_loss_scale(
            list(self._scales),
            init_scale=self._init_scale,
            window=t.window,
            collapse_octaves=t.collapse_octaves,
            falling_run=t.falling_run,
            min_skips=t.min_skips,
        )
        if verdict is None:
            return
        recent = [[s, v] for s, v in list(prec.stats.scale_history)[-12:]]
        finding = loss_scale_collapse(
            verdict,
            step=report.step,
            consecutive_skips=prec.stats.consecutive_skips,
            skipped_steps=prec.stats.skipped_steps,
            recent_scales=recent,
        )
        self._ledger.record(report.step, verdict.octaves_below_init, finding)
