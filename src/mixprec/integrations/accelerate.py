"""mixprec in an Accelerate loop: the README loop's calls, with Accelerate's conventions.

    accelerator = Accelerator(gradient_accumulation_steps=4)   # mixed_precision "no"
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(model)
    opt = prec.optimizer(model, lr=3e-4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    loop = AcceleratedPrecision(accelerator, prec)
    for batch in loader:
        with accelerator.accumulate(model):
            with prec.autocast():
                loss = model(**batch).loss
            loop.backward(loss)
            loop.step(opt, sched, max_norm=1.0)

`AcceleratedPrecision` refuses an `Accelerator` whose own ``mixed_precision`` is
not ``"no"`` (its autocast and scaler would run beside the policy's), divides the
loss by the accumulation steps as ``accelerator.backward`` does, and steps only at
an accumulation boundary (``accelerator.sync_gradients``): clip the true gradients,
`Precision.step` (a non-finite update is skipped), the scheduler only when the
step was applied, then ``zero_grad``. The `Precision` is registered for
checkpointing, so ``accelerator.save_state``/``load_state`` keep the loss scale
with the model, optimizer (masters, moments) and scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.engine import Precision, StepReport
from mixprec.engine.release import refuse_trainer
from mixprec.integrations.metrics import step_metrics

__all__ = ["AcceleratedPrecision"]


class AcceleratedPrecision:
    """The README loop's backward and step for an ``accelerate.Accelerator`` (module docs).

    Args:
        accelerator: the run's ``Accelerator``, built with ``mixed_precision="no"``.
        prec: the run's `Precision`, or a policy name to build one from.

    Raises:
        ValueError: the accelerator has its own mixed precision.
    """

    def __init__(self, accelerator: Any, prec: Precision | str) -> None:
        self.prec = Precision(prec) if isinstance(prec, str) else prec
        refuse_trainer(self.prec.policy, "AcceleratedPrecision")
        mixed = str(accelerator.mixed_precision)
        if mixed != "no":
            raise ValueError(
                f"Accelerator(mixed_precision={mixed!r}) with mixprec policy "
                f"{self.prec.policy.name!r}: both would set autocast and loss scaling; build "
                "Accelerator(mixed_precision='no') and let the policy decide"
            )
        self.accelerator = accelerator
        accelerator.register_for_checkpointing(self.prec)
        #: The last step's `StepReport` (None before the first step).
        self.last_report: StepReport | None = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`Precision.backward` of the loss divided by the accumulation steps (as
        ``accelerator.backward``)."""
        steps = int(self.accelerator.gradient_accumulation_steps)
        self.prec.backward(loss / steps if steps > 1 else loss, **kwargs)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        max_norm: float | None = None,
    ) -> StepReport | None:
        """At an accumulation boundary: clip (true gradients, by `max_norm`), step,
        advance `scheduler` if the step was applied, zero the gradients, and log the
        `step_metrics` to the accelerator's trackers. Between boundaries
        nothing happens and None is returned. With trackers, `step_metrics` is logged."""
        if not self.accelerator.sync_gradients:
            return None
        if max_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.prec.clip_grad_norm_(params, max_norm, optimizer=optimizer)
        report = self.last_report = self.prec.step(optimizer)
        if scheduler is not None and report.applied:  # a skipped step is not in the schedule
            scheduler.step()
        optimizer.zero_grad()
        if self.accelerator.trackers:
            self.accelerator.log(step_metrics(self.prec), step=report.step)
        return report
