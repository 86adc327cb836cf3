"""``nonfinite-source``: the first module whose forward output turned inf/NaN.

After a step with non-finite gradients, `NonfiniteObserver` hooks every module
of the model (`NonfiniteHunter`) for up to ``hunt_steps`` steps, at most
``max_hunts`` times per run, and removes the hooks once it has an answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.runtime.hunter import NonfiniteHit, NonfiniteHunter
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.rules import nonfinite_not_in_forward, nonfinite_source
from mixprec.doctor.runtime.thresholds import ProbeThresholds

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["NonfiniteObserver"]


class NonfiniteObserver:
    """A `StepObserver` that hunts the source of non-finite gradients.

    Args:
        ledger: where findings go.
        thresholds: ``hunt_steps`` and ``max_hunts`` are read.
        index: the model to hook (nothing is hunted without one).
    """

    def __init__(
        self, *, ledger: FindingLedger, thresholds: ProbeThresholds, index: ModelIndex
    ) -> None:
        self._ledger = ledger
        self._thresholds = thresholds
        self._index = index
        self._hunter: NonfiniteHunter | None = None
        self._watched = 0
        self._hunts = 0
        self._first_step: int | None = None
        self._found = False

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Nothing: the hunt follows the steps' reports."""

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Judge a running hunt, or start one after non-finite gradients."""
        if self._hunter is not None:
            self._watched += 1
            hit = self._hunter.hit
            if hit is not None:
                self.stop()
                self._found = True
                self._report_source(prec, report.step, hit)
            elif self._watched >= self._thresholds.hunt_steps:
                self.stop()
                if not prec.policy.scales_loss:
                    self._report_no_source(report.step)
            return
        if report.nonfinite_grads <= 0:
            return
        if self._first_step is None:
            self._first_step = report.step
        model = self._index.model
        if model is None or self._found or self._hunts >= self._thresholds.max_hunts:
            return
        self._hunter = NonfiniteHunter(model)
        self._hunter.install()
        self._hunts += 1
        self._watched = 0

    def stop(self) -> None:
        """Remove the hunt's hooks, if any."""
        if self._hunter is not None:
            self._hunter.remove()
            self._hunter = None

    def _report_source(self, prec: Precision, step: int, hit: NonfiniteHit) -> None:
        finding = nonfinite_source(
            hit,
            step=step,
            first_nonfinite_step=self._first_step,
            compute=prec.policy.effective_compute_dtype,
        )
        self._ledger.record(step, 1.0, finding)

    def _report_no_source(self, step: int) -> None:
        finding = nonfinite_not_in_forward(
            first_nonfinite_step=self._first_step, steps_watched=self._thresholds.hunt_steps
        )
        self._ledger.record(step, 0.0, finding)
