"""``clip-before-unscale``: gradients clipped (changed in place) while still scaled.

Nothing is wrapped or patched: `Precision` notes, from the gradients' version
counters, whether any gradient was changed in place between ``prec.backward``
and its unscale (`Precision.gradients_changed_while_scaled`), which is what
``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` on still-scaled
gradients does. Clipping through ``prec.clip_grad_norm_`` unscales first, so
it never counts. This observer reads that note before the update and words the
finding after it, with the step's (unscaled) gradient norm.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.measure import ScaledGradientChange
from mixprec.doctor.runtime.rules import clip_before_unscale
from mixprec.errors import user_stacklevel

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["ClipObserver"]


def _caller() -> str:
    """``file:line`` of the first caller outside mixprec (the training loop's ``prec.step``)."""
    try:
        frame = sys._getframe(user_stacklevel() - 1)
    except ValueError:  # no frame outside mixprec
        return "unknown"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class ClipObserver:
    """A `StepObserver` that reports gradients changed in place before their unscale.

    Args:
        ledger: where findings go.
    """

    def __init__(self, *, ledger: FindingLedger) -> None:
        self._ledger = ledger
        self._pending: tuple[int, str] | None = None

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Note whether this step's gradients were changed while still scaled."""
        self._pending = (step, _caller()) if prec.gradients_changed_while_scaled else None

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Report a change noted before the update, with the step's gradient norm."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != report.step:
            return
        step, caller = pending
        change = ScaledGradientChange(caller=caller, grad_norm=report.grad_norm)
        self._ledger.record(
            step, 0.0, clip_before_unscale(change, step=step, loss_scale=report.scale)
        )
