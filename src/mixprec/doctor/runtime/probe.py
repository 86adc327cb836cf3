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
reading one `ProbeThresholds`: on sampled steps (every `every` steps) the
gradients against fp16's range (`GradientObserver`, ``gradient-underflow``)
and whether non-zero updates changed 16-bit stored parameters
(`UpdateObserver`, ``vanishing-updates``); on every step the loss scale
(`LossScaleObserver`, ``loss-scale-collapse``), gradients changed in place
while still scaled (`ClipObserver`, ``clip-before-unscale``), and after
non-finite gradients the first module whose output turned inf/NaN
(`NonfiniteObserver`, ``nonfinite-source``). Nothing global is changed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.doctor.findings import Finding
from mixprec.doctor.runtime.clipping import ClipObserver
from mixprec.doctor.runtime.gradients import GradientObserver
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.loss_scale import LossScaleObserver
from mixprec.doctor.runtime.measure import GradientStats, UpdateStats
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.nonfinite import NonfiniteObserver
from mixprec.doctor.runtime.thresholds import ProbeThresholds, check_count
from mixprec.doctor.runtime.updates import UpdateObserver
from mixprec.dtypes import dtype_name

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["DEFAULT_EVERY", "Probe", "ProbeSample"]

#: Default sampling period, chosen with bench/doctor_overhead.py: about 3-5% of a
#: small bf16 MLP's step time on a CPU (docs/doctor.md, "Cost"); every=5 nears 10%.
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
    """

    step: int
    compute_dtype: str
    loss_scale: float | None
    grads: GradientStats
    updates: UpdateStats | None
    master_updates: UpdateStats | None
    applied: bool

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
        }


class Probe:
    """Runtime probes for a `Precision` run (a `StepObserver`).

    Args:
        every: sample gradients and updates every this many steps (the loss-scale
            trend, clipping and the non-finite hunt are followed on every step).
        model: the model; needed to hunt ``nonfinite-source`` and to name
            parameters in evidence. Embedding parameters are left out of the
            zero-gradient count (unused rows are legitimately zero).
        underflow_threshold, zero_threshold, vanishing_threshold, window,
            collapse_octaves, falling_run, min_skips, hunt_steps, max_hunts: the
            fields of `ProbeThresholds` (see there), kept as `thresholds`.
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
        underflow_threshold: float = _DEFAULTS.underflow_threshold,
        zero_threshold: float = _DEFAULTS.zero_threshold,
        vanishing_threshold: float = _DEFAULTS.vanishing_threshold,
        window: int = _DEFAULTS.window,
        collapse_octaves: int = _DEFAULTS.collapse_octaves,
        falling_run: int = _DEFAULTS.falling_run,
        min_skips: int = _DEFAULTS.min_skips,
        hunt_steps: int = _DEFAULTS.hunt_steps,
        max_hunts: int = _DEFAULTS.max_hunts,
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
        )
        self.every = every
        self._index = ModelIndex(model)
        self._ledger = FindingLedger()
        self._samples: deque[ProbeSample] = deque(maxlen=max_samples)
        self._precs: list[weakref.ref[Precision]] = []
        t = self.thresholds
        self._clip = ClipObserver(ledger=self._ledger)
        self._gradients = GradientObserver(
            ledger=self._ledger, thresholds=t, index=self._index, every=every
        )
        self._updates = UpdateObserver(
            ledger=self._ledger,
            thresholds=t,
            index=self._index,
            every=every,
            track_masters=track_masters,
        )
        self._loss_scale = LossScaleObserver(ledger=self._ledger, thresholds=t)
        self._nonfinite = NonfiniteObserver(ledger=self._ledger, thresholds=t, index=self._index)

    @property
    def model(self) -> nn.Module | None:
        """The model the probe hunts in and names parameters of."""
        return self._index.model

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        self._index.model = model

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
        return self

    def detach(self, prec: Precision | None = None) -> None:
        """Stop observing (`prec`, or every run seen) and remove any hooks."""
        precs = [prec] if prec is not None else self._live_precs()
        for p in precs:
            if self in p.observers:
                p.remove_observer(self)
        self._nonfinite.stop()

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
        try:
            yield self
        finally:
            self._nonfinite.stop()
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
        ``_max``); ``vanishing_update_fraction`` and ``master_unchanged_fraction``
        (``_mean``/``_max``) when such updates were measured.
        """
        out: dict[str, float] = {"samples": float(len(self._samples))}
        series: dict[str, list[float]] = {
            "grad_zero_fraction": [s.grads.zero_fraction for s in self._samples],
            "grad_underflow_fraction": [s.grads.underflow_fraction for s in self._samples],
            "grad_flush_fraction": [s.grads.flush_fraction for s in self._samples],
            "grad_overflow_fraction": [s.grads.overflow_fraction for s in self._samples],
            "vanishing_update_fraction": [
                s.updates.fraction for s in self._samples if s.updates and s.updates.intended
            ],
            "master_unchanged_fraction": [
                s.master_updates.fraction
                for s in self._samples
                if s.master_updates and s.master_updates.intended
            ],
        }
        for name, values in series.items():
            if values:
                out[f"{name}_mean"] = sum(values) / len(values)
                out[f"{name}_max"] = max(values)
        return out

    def findings(self) -> list[Finding]:
        """Every runtime finding so far, errors first; each says when it was seen."""
        return self._ledger.findings()

    # ------------------------------------------------------ observer hooks

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Gradients are final (unscaled): each observer looks before the update."""
        self._see(prec)
        self._clip.before_step(prec, optimizers, step)
        self._gradients.before_step(prec, optimizers, step)
        self._updates.before_step(prec, optimizers, step)

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Each observer judges the step; a sampled step's measurements are kept."""
        self._see(prec)
        self._clip.after_step(prec, optimizers, report)
        self._loss_scale.after_step(prec, optimizers, report)
        self._updates.after_step(prec, optimizers, report)
        grads = self._gradients.take(report.step)
        updates = self._updates.take(report.step)
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
                )
            )
        self._nonfinite.after_step(prec, optimizers, report)
