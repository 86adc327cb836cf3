"""``gradient-underflow``: where sampled gradients fall against fp16's range."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.measure import GradientStats, gradient_stats
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.rules import gradient_underflow
from mixprec.doctor.runtime.thresholds import ProbeThresholds

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["GradientObserver", "GradientSample"]


@dataclass(frozen=True, kw_only=True)
class GradientSample:
    """The gradients of one sampled step.

    Attributes:
        step: the step index.
        stats: where the gradient elements fall against fp16's range.
        compute_dtype: the run's effective compute dtype.
        loss_scale: the loss scale of the step (None without scaling).
    """

    step: int
    stats: GradientStats
    compute_dtype: torch.dtype
    loss_scale: float | None


class GradientObserver:
    """A `StepObserver` that counts gradient elements on every `every`-th step.

    In `before_step` the gradients are final and unscaled; embedding parameters
    are left out (their unused rows are legitimately zero).

    Args:
        ledger: where findings go.
        thresholds: ``underflow_threshold`` and ``zero_threshold`` are read.
        index: the model's parameters (for the embeddings to leave out).
        every: the sampling period.
    """

    def __init__(
        self,
        *,
        ledger: FindingLedger,
        thresholds: ProbeThresholds,
        index: ModelIndex,
        every: int,
    ) -> None:
        self._ledger = ledger
        self._thresholds = thresholds
        self._index = index
        self.every = every
        self._latest: GradientSample | None = None

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Measure the gradients on a sampled step and judge them."""
        self._latest = None
        if step % self.every != 0:
            return
        skip = self._index.embedding_ids()
        grads = [
            p.grad
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in skip
        ]
        stats = gradient_stats(g for g in grads if g is not None)
        policy = prec.policy
        scale = prec.loss_scale
        compute = policy.effective_compute_dtype
        finding = gradient_underflow(
            stats,
            step=step,
            compute=compute,
            scales=policy.scales_loss,
            loss_scale=scale,
            fp16_in_use=torch.float16 in (policy.reduce_dtype, policy.param_dtype),
            zero_threshold=self._thresholds.zero_threshold,
            underflow_threshold=self._thresholds.underflow_threshold,
        )
        if finding is not None:
            value = stats.zero_fraction if compute == torch.float16 else stats.underflow_fraction
            self._ledger.record(step, value, finding)
        self._latest = GradientSample(
            step=step, stats=stats, compute_dtype=compute, loss_scale=scale
        )

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Nothing: gradients are judged before the update."""

    def take(self, step: int) -> GradientSample | None:
        """The sample of `step` if it was sampled (once: it is then forgotten)."""
        latest, self._latest = self._latest, None
        return latest if latest is not None and latest.step == step else None
