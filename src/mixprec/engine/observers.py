"""`StepObserver`: the protocol of what watches `Precision.step` (the doctor's probes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from mixprec.engine.precision import Precision
    from mixprec.telemetry import StepReport

__all__ = ["StepObserver"]


@runtime_checkable
class StepObserver(Protocol):
    """Something that watches steps (the doctor's runtime probes implement this).

    `before_step` runs once gradients are unscaled and checked, before the update;
    `after_step` runs after the update (or the skip), before collapse checks.
    """

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Gradients are final (unscaled); parameters hold their pre-update values."""

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """The update was applied or skipped, as `report` says."""
