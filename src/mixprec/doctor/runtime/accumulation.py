"""``grad-accum-16bit``: gradients of 16-bit parameters summed in 16 bits over micro-batches.

Autograd adds each backward's gradient into ``.grad`` in the parameter's dtype, so a
step that accumulates N micro-batches under bf16 storage rounds its gradient sum N - 1
times. On each sampled step of a policy without ``grad_accum_dtype`` this observer
hooks the 16-bit parameters with the engine's own `Fp32Accumulation` in witness mode
(``write=False``: it keeps an fp32 sum of the same incoming gradients and changes
nothing), and before the update compares ``.grad`` with that sum, times the one
factor (unscale, clip) fitted by least squares. It costs 4 bytes per
16-bit parameter on sampled steps only; the hooks are removed after each sample.

The parameters come from the probe's model, and from the optimizers of earlier steps
(without a model the first step is not watched). FSDP2 accumulates sharded gradients
in its own hooks, which a tensor hook does not see: nothing is reported there.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.rules import grad_accum_16bit
from mixprec.doctor.runtime.schedule import SampleSchedule
from mixprec.engine.accumulation import Fp32Accumulation
from mixprec.engine.gradients import SIXTEEN_BIT

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["AccumulationObserver"]


class AccumulationObserver:
    """A `StepObserver` that measures 16-bit gradient accumulation on sampled steps.

    Args:
        ledger: where findings go.
        index: the model whose 16-bit parameters are watched.
        schedule: which steps are sampled.
    """

    def __init__(
        self, *, ledger: FindingLedger, index: ModelIndex, schedule: SampleSchedule
    ) -> None:
        self._ledger = ledger
        self._index = index
        self.schedule = schedule
        self._witness = Fp32Accumulation(write=False)
        self._armed: int | None = None
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}  # optimizers' 16-bit params

    def arm_next(self, prec: Precision, step: int) -> None:
        """Hook the 16-bit parameters for `step` if it is sampled and the policy sums
        gradients in their own dtype."""
        self.stop()
        plan = prec.plan
        if plan.grad_accum_dtype is not None or plan.storage_dtype not in SIXTEEN_BIT:
            return
        if not self.schedule.is_sampled(step):
            return
        params = [p for p in (ref() for ref in self._seen.values()) if p is not None]
        model = self._index.model
        if model is not None:
            params += list(model.parameters())
        self._witness.hook(params)
        self._armed = step

    def stop(self) -> None:
        """Remove the hooks and free the sums."""
        self._witness.unhook()
        self._armed = None

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """On an armed step, compare each accumulated ``.grad`` with its fp32 sum."""
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.dtype in SIXTEEN_BIT and p.requires_grad:
                        self._seen[id(p)] = weakref.ref(p)
        if self._armed != step:
            return
        backwards = self._witness.backwards
        if backwards >= 2:
            self._judge(prec, step, backwards)
        self.stop()

    def _judge(self, prec: Precision, step: int, backwards: int) -> None:
        pairs = [
            (grad, total)
            for p, total, count in self._witness.sums()
            if (grad := p.grad) is not None and count >= 2
        ]
        if not pairs:
            return
        dtype = pairs[0][0].dtype
        # Between the backwards and the update, .grad was multiplied by one factor for
        # all parameters: unscaled (1 / loss scale) and clipped (max_norm / norm). It is
        # fitted by least squares, so the error is the summation's, not the factor.
        dot = sum(float((g.double() * t.double()).sum()) for g, t in pairs)
        norm = sum(float(t.double().pow(2).sum()) for _, t in pairs)
        if not (norm > 0 and math.isfinite(norm) and math.isfinite(dot)):
            return
        factor = dot / norm
        err = floor = 0.0
        for g, t in pairs:
            ref = t.double() * factor
            err += float((g.double() - ref).pow(2).sum())
            floor += float((ref.to(dtype).double() - ref).pow(2).sum())
        norm *= factor * factor
        if not (norm > 0 and math.isfinite(err)):
            return
        rel = math.sqrt(err / norm)
        counted = len(pairs)
        finding = grad_accum_16bit(
            step=step,
            backwards=backwards,
            grad_dtype=dtype,
            relative_error=rel,
            one_rounding_error=math.sqrt(floor / norm),
            params=counted,
            policy=prec.plan.policy_name,
        )
        self._ledger.record(step, rel, finding)

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Nothing: gradients are judged before the update."""
