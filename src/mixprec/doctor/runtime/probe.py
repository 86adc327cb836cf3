"""`Probe`: the runtime diagnoses, one observer each, watching a `Precision` run.

`Probe` implements the `StepObserver` protocol of `mixprec.engine`::

    probe = mixprec.doctor.Probe(model=model)   # model: needed to hunt non-finite sources
    with probe.watching(prec):                  # attaches; detaches and unhooks on exit
        for x, y in loader:
            ...
            prec.backward(loss)
            prec.clip_grad_norm_(model.parameters(), 1.0)
            prec.step(optimizer)
    for finding in probe.findings():
        print(finding.rule, finding.message)

It composes one observer per diagnosis, all writing to one `FindingLedger` and
reading one `ProbeThresholds`: on sampled steps (`SampleSchedule`: at most one
every `every` steps, spaced further so that the probe's own time stays within
`overhead_budget` of the run's) the gradients against fp16's range, with an
fp32 replay of the step to split fp16 zeros into underflow and structural ones
(`GradientObserver`, ``gradient-underflow``), and whether non-zero updates
changed 16-bit stored parameters (`UpdateObserver`, ``vanishing-updates``), and
whether 16-bit gradients were summed in 16 bits over several backward passes, against
an fp32 sum of the same gradients (`AccumulationObserver`, ``grad-accum-16bit``); on
every step the loss scale
(`LossScaleObserver`, ``loss-scale-collapse``), gradients changed in place
while still scaled (`ClipObserver`, ``clip-before-unscale``), and after
non-finite gradients the first module whose output turned inf/NaN
(`NonfiniteObserver`, ``nonfinite-source``); on sampled steps of a model with
torchao fp8 layers, what their fp8 casts clip and flush, measured and under a
delayed-scaling what-if (`Fp8Observer`, ``fp8-saturation``, ``fp8-underflow``,
``format-not-accelerated``). Nothing global is changed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.doctor.findings import Finding
from mixprec.doctor.runtime.accumulation import AccumulationObserver
from mixprec.doctor.runtime.clipping import ClipObserver
from mixprec.doctor.runtime.fp8 import Fp8Observer
from mixprec.doctor.runtime.fp8_measure import Fp8TensorSample
from mixprec.doctor.runtime.gradients import GradientObserver
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.loss_scale import LossScaleObserver
from mixprec.doctor.runtime.measure import GradientStats, UpdateStats, ZeroBreakdown
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.nonfinite import NonfiniteObserver
from mixprec.doctor.runtime.schedule import DEFAULT_OVERHEAD_BUDGET, ProbeCost, SampleSchedule
from mixprec.doctor.runtime.thresholds import ProbeThresholds, check_count
from mixprec.doctor.runtime.updates import UpdateObserver
from mixprec.dtypes import dtype_name

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["DEFAULT_EVERY", "DEFAULT_OVERHEAD_BUDGET", "Probe", "ProbeSample"]

#: Default least number of steps between two samples. The time budget
#: (`DEFAULT_OVERHEAD_BUDGET`) spaces samples further where a sample costs more than
#: that share of `DEFAULT_EVERY` steps (fast steps, large models; docs/doctor.md, "Cost").
DEFAULT_EVERY = 10

_DEFAULTS = ProbeThresholds()


@dataclass(frozen=True, kw_only=True)
class ProbeSample:
    """What a probe measured on one sampled step.

    Attributes:
        step: the step index.
        compute_dtype: the run's effective compute dtype.
        loss_scale: the loss scale of the step (None without scaling).
        grads: the gradients against fp16's range.
        updates: 16-bit parameters without a master: non-zero gradient, unchanged
            stored value (None when there were none, or the step was skipped).
        master_updates: 16-bit parameters with a master: update intended (non-zero
            gradient, or with ``track_masters`` the master changed), stored 16-bit
            value unchanged (expected and harmless: the master keeps it).
        applied: whether the step's update was applied.
        zero_breakdown: fp16 compute: the zeros split into underflow and structural
            by an fp32 replay of the step (None when none ran; see `reference`).
        reference: ``"fp32 replay"``, or why the zeros were not split (empty when
            no split was needed: other compute dtypes, zeros below the threshold).
        fp8: the fp8 layers' tensors (weight, input, output gradient) as their casts
            treated them on this step (empty without fp8 layers).
    """

    step: int
    compute_dtype: str
    loss_scale: float | None
    grads: GradientStats
    updates: UpdateStats | None
    master_updates: UpdateStats | None
    applied: bool
    zero_breakdown: ZeroBreakdown | None = None
    reference: str = ""
    fp8: tuple[Fp8TensorSample, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "step": self.step,
            "compute_dtype": self.compute_dtype,
            "loss_scale": self.loss_scale,
            "grads": self.grads.to_dict(),
            "updates": None if self.updates is None else self.updates.to_dict(),
            "master_updates": None
            if self.master_updates is None
            else self.master_updates.to_dict(),
            "applied": self.applied,
            "zero_breakdown": None
            if self.zero_breakdown is None
            else self.zero_breakdown.to_dict(),
            "reference": self.reference,
            "fp8": [t.to_dict() for t in self.fp8],
        }


class Probe:
    """Runtime probes for a `Precision` run (a `StepObserver`).

    Args:
        every: sample gradients and updates at most every this many steps (the
            loss-scale trend, clipping and the non-finite hunt are followed on
            every step).
        overhead_budget: the share of the run's time the probe's own step
            callbacks may take, measured with `clock` (in (0, 1]; default 5%):
            each second of the run outside the probe earns it this many seconds,
            it banks at most one sample's worth, and it samples (no sooner than
            `every` steps after the last sample) once it holds what its last sample
            cost (`SampleSchedule`). None: sample exactly every `every` steps
            (deterministic).
        model: the model; needed to hunt ``nonfinite-source``, to replay sampled
            fp16-compute steps in fp32 and to name parameters in evidence.
            Embedding parameters are left out of the zero-gradient count (unused
            rows are legitimately zero).
        fp32_replay: in fp16-compute runs, when a sample's exact zeros reach
            `zero_threshold`, replay that step's forward and backward in fp32 (the
            probe records the forward of each step it will sample) and count as
            underflow only zeros whose fp32 gradient is non-zero. It costs an fp32
            forward and backward of the batch on those samples (within the budget).
        clock: the time source of the budget (``time.perf_counter``; tests inject one).
        underflow_threshold, zero_threshold, vanishing_threshold, window,
            collapse_octaves, falling_run, min_skips, hunt_steps, max_hunts,
            fp8_saturation_threshold, fp8_underflow_threshold, fp8_amax_history_len,
            fp8_margin, fp8_amax_compute_algo: the fields of `ProbeThresholds` (see
            there), kept as `thresholds`.
        max_samples: how many `ProbeSample` records are kept (the latest).
        track_masters: for `mixprec.optim` optimizers with a master, take "the
            master value changed" as the intent of an update (exact, but it
            reconstructs every master twice per sampled step with
            ``master_weights()``, which can cost more than a step); by default the
            intent is "the gradient is non-zero" for every parameter.
    """

    def __init__(
        self,
        *,
        every: int = DEFAULT_EVERY,
        model: nn.Module | None = None,
        overhead_budget: float | None = DEFAULT_OVERHEAD_BUDGET,
        fp32_replay: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        underflow_threshold: float = _DEFAULTS.underflow_threshold,
        zero_threshold: float = _DEFAULTS.zero_threshold,
        vanishing_threshold: float = _DEFAULTS.vanishing_threshold,
        window: int = _DEFAULTS.window,
        collapse_octaves: int = _DEFAULTS.collapse_octaves,
        falling_run: int = _DEFAULTS.falling_run,
        min_skips: int = _DEFAULTS.min_skips,
        hunt_steps: int = _DEFAULTS.hunt_steps,
        max_hunts: int = _DEFAULTS.max_hunts,
        fp8_saturation_threshold: float = _DEFAULTS.fp8_saturation_threshold,
        fp8_underflow_threshold: float = _DEFAULTS.fp8_underflow_threshold,
        fp8_amax_history_len: int = _DEFAULTS.fp8_amax_history_len,
        fp8_margin: int = _DEFAULTS.fp8_margin,
        fp8_amax_compute_algo: str = _DEFAULTS.fp8_amax_compute_algo,
        max_samples: int = 1000,
        track_masters: bool = False,
    ) -> None:
        check_count("every", every, 1)
        check_count("max_samples", max_samples, 1)
        self.thresholds = ProbeThresholds(
            underflow_threshold=underflow_threshold,
            zero_threshold=zero_threshold,
            vanishing_threshold=vanishing_threshold,
            window=window,
            collapse_octaves=collapse_octaves,
            falling_run=falling_run,
            min_skips=min_skips,
            hunt_steps=hunt_steps,
            max_hunts=max_hunts,
            fp8_saturation_threshold=fp8_saturation_threshold,
            fp8_underflow_threshold=fp8_underflow_threshold,
            fp8_amax_history_len=fp8_amax_history_len,
            fp8_margin=fp8_margin,
            fp8_amax_compute_algo=fp8_amax_compute_algo,
        )
        self._schedule = SampleSchedule(every=every, overhead_budget=overhead_budget, clock=clock)
        self._index = ModelIndex(model)
        self._ledger = FindingLedger()
        self._last_step_optimizers: frozenset[int] = frozenset()
        self._warned_split = False
        self._samples: deque[ProbeSample] = deque(maxlen=max_samples)
        self._precs: list[weakref.ref[Precision]] = []
        t = self.thresholds
        self._clip = ClipObserver(ledger=self._ledger)
        self._gradients = GradientObserver(
            ledger=self._ledger,
            thresholds=t,
            index=self._index,
            schedule=self._schedule,
            fp32_replay=fp32_replay,
        )
        self._updates = UpdateObserver(
            ledger=self._ledger,
            thresholds=t,
            index=self._index,
            schedule=self._schedule,
            track_masters=track_masters,
        )
        self._loss_scale = LossScaleObserver(ledger=self._ledger, thresholds=t)
        self._nonfinite = NonfiniteObserver(ledger=self._ledger, thresholds=t, index=self._index)
        self._fp8 = Fp8Observer(
            ledger=self._ledger, thresholds=t, index=self._index, schedule=self._schedule
        )
        self._accumulation = AccumulationObserver(
            ledger=self._ledger, index=self._index, schedule=self._schedule
        )

    @property
    def model(self) -> nn.Module | None:
        """The model the probe hunts in and names parameters of."""
        return self._index.model

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        self._index.model = model

    @property
    def every(self) -> int:
        """The least number of steps between two samples."""
        return self._schedule.every

    @property
    def overhead_budget(self) -> float | None:
        """The share of the run's time the probe may take (None: every `every` steps)."""
        return self._schedule.overhead_budget

    @property
    def fp32_replay(self) -> bool:
        """Whether sampled fp16-compute steps are replayed in fp32 (see the class)."""
        return self._gradients.fp32_replay

    @property
    def cost(self) -> ProbeCost:
        """What the probe has cost so far: its own seconds, the run's, steps sampled."""
        return self._schedule.cost

    @property
    def track_masters(self) -> bool:
        """Whether "the master value changed" is the intent of an update (see the class)."""
        return self._updates.track_masters

    # ------------------------------------------------------------ attaching

    def attach(self, prec: Precision, model: nn.Module | None = None) -> Probe:
        """Observe `prec`'s steps until `detach`.

        Args:
            prec: the run to observe.
            model: the model (replaces the constructor's `model` when given).
        """
        if model is not None:
            self.model = model
        if self not in prec.observers:
            prec.add_observer(self)
        self._see(prec)
        self._arm(prec, prec.stats.steps)
        return self

    def detach(self, prec: Precision | None = None) -> None:
        """Stop observing (`prec`, or every run seen) and remove any hooks."""
        precs = [prec] if prec is not None else self._live_precs()
        for p in precs:
            if self in p.observers:
                p.remove_observer(self)
        self._stop()

    def _arm(self, prec: Precision, step: int) -> None:
        self._gradients.arm_next(prec, step)
        self._fp8.arm_next(prec, step)
        self._accumulation.arm_next(prec, step)

    def _stop(self) -> None:
        self._nonfinite.stop()
        self._gradients.stop()
        self._fp8.stop()
        self._accumulation.stop()

    @contextlib.contextmanager
    def watching(self, prec: Precision | None = None) -> Iterator[Probe]:
        """A context that attaches to `prec` (if given) and, on exit, detaches from it
        and removes any hooks.

        Without `prec`, the probe must be added with ``prec.add_observer(probe)``.
        """
        added = prec is not None and self not in prec.observers
        if prec is not None:
            if added:
                prec.add_observer(self)
            self._see(prec)
            self._arm(prec, prec.stats.steps)
        try:
            yield self
        finally:
            self._stop()
            if prec is not None and added and self in prec.observers:
                prec.remove_observer(self)

    def _see(self, prec: Precision) -> None:
        if not any(ref() is prec for ref in self._precs):
            self._precs.append(weakref.ref(prec))

    def _live_precs(self) -> list[Precision]:
        return [p for p in (ref() for ref in self._precs) if p is not None]

    # ------------------------------------------------------------- results

    @property
    def samples(self) -> tuple[ProbeSample, ...]:
        """The measurements of the sampled steps (the latest `max_samples`)."""
        return tuple(self._samples)

    def summary(self) -> dict[str, float]:
        """Mean and max over the kept samples of each measured fraction, by name.

        Keys: ``samples``; ``grad_zero_fraction``, ``grad_underflow_fraction``,
        ``grad_flush_fraction``, ``grad_overflow_fraction`` (each ``_mean`` and
        ``_max``); ``grad_underflow_zero_fraction`` (zeros non-zero in fp32, of the
        elements non-zero in fp32) and ``grad_structural_zero_fraction`` (zeros
        zero in fp32 too, of all elements) when fp32 replays ran;
        ``vanishing_update_fraction`` and ``master_unchanged_fraction``
        (``_mean``/``_max``) when such updates were measured; with fp8 layers,
        ``fp8_saturated_fraction``, ``fp8_underflow_fraction`` and
        ``fp8_delayed_saturated_fraction`` (the what-if), each the worst tensor of
        a sample (``_mean``/``_max`` over samples).
        """
        out: dict[str, float] = {"samples": float(len(self._samples))}
        series: dict[str, list[float]] = {
            "grad_zero_fraction": [s.grads.zero_fraction for s in self._samples],
            "grad_underflow_fraction": [s.grads.underflow_fraction for s in self._samples],
            "grad_flush_fraction": [s.grads.flush_fraction for s in self._samples],
            "grad_overflow_fraction": [s.grads.overflow_fraction for s in self._samples],
            "grad_underflow_zero_fraction": [
                s.zero_breakdown.underflow_fraction for s in self._samples if s.zero_breakdown
            ],
            "grad_structural_zero_fraction": [
                s.zero_breakdown.structural_fraction for s in self._samples if s.zero_breakdown
            ],
            "vanishing_update_fraction": [
                s.updates.fraction for s in self._samples if s.updates and s.updates.intended
            ],
            "master_unchanged_fraction": [
                s.master_updates.fraction
                for s in self._samples
                if s.master_updates and s.master_updates.intended
            ],
            "fp8_saturated_fraction": [
                max(t.saturated_fraction for t in s.fp8) for s in self._samples if s.fp8
            ],
            "fp8_underflow_fraction": [
                max(t.underflow_fraction for t in s.fp8) for s in self._samples if s.fp8
            ],
            "fp8_delayed_saturated_fraction": [
                max(t.delayed_saturated_fraction for t in s.fp8) for s in self._samples if s.fp8
            ],
        }
        for name, values in series.items():
            if values:
                out[f"{name}_mean"] = sum(values) / len(values)
                out[f"{name}_max"] = max(values)
        return out

    @property
    def fp8_amax_history(self) -> dict[str, tuple[float, ...]]:
        """The amax history of each fp8 tensor (``"layer (role)"``: weight, input,
        grad_output), oldest first, at most ``fp8_amax_history_len`` samples."""
        return self._fp8.amax_history

    def findings(self) -> list[Finding]:
        """Every runtime finding so far, errors first; each says when it was seen."""
        return self._ledger.findings()

    # ------------------------------------------------------ observer hooks

    def _check_split_steps(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Warn once when consecutive `prec.step` calls step disjoint optimizers: samples
        fall on every N-th call, so with one call per optimizer they keep seeing the same
        one (found by review: a second optimizer's vanishing updates went unmeasured)."""
        ids = frozenset(id(o) for o in optimizers)
        last, self._last_step_optimizers = self._last_step_optimizers, ids
        if last and ids and last.isdisjoint(ids) and not self._warned_split:
            self._warned_split = True
            warnings.warn(
                "mixprec.doctor.Probe: consecutive prec.step calls step different optimizers; "
                "a sample sees only the optimizers of the call it falls on, so some may never "
                "be measured: step them together with prec.step([opt_a, opt_b])",
                UserWarning,
                stacklevel=4,
            )

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Gradients are final (unscaled): each observer looks before the update."""
        since = self._schedule.begin(step)
        self._check_split_steps(optimizers)
        self._see(prec)
        self._clip.before_step(prec, optimizers, step)
        self._gradients.before_step(prec, optimizers, step)
        self._updates.before_step(prec, optimizers, step)
        self._fp8.before_step(prec, optimizers, step)
        self._accumulation.before_step(prec, optimizers, step)
        self._schedule.charge(since)

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Each observer judges the step; a sampled step's measurements are kept; the
        next step to sample is decided (and its forward recorded for a replay)."""
        since = self._schedule.begin(report.step)
        self._see(prec)
        self._clip.after_step(prec, optimizers, report)
        self._loss_scale.after_step(prec, optimizers, report)
        self._updates.after_step(prec, optimizers, report)
        grads = self._gradients.take(report.step)
        updates = self._updates.take(report.step)
        fp8 = self._fp8.take(report.step)
        if grads is not None:
            self._samples.append(
                ProbeSample(
                    step=grads.step,
                    compute_dtype=dtype_name(grads.compute_dtype),
                    loss_scale=grads.loss_scale,
                    grads=grads.stats,
                    updates=None if updates is None else updates.updates,
                    master_updates=None if updates is None else updates.master_updates,
                    applied=report.applied,
                    zero_breakdown=grads.zero_breakdown,
                    reference=grads.reference,
                    fp8=fp8,
                )
            )
        self._nonfinite.after_step(prec, optimizers, report)
        self._schedule.charge(since)
        self._schedule.plan_next(report.step)
        self._arm(prec, report.step + 1)
