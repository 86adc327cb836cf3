"""Runtime probes: watch a `Precision` run and report what degrades it, with evidence.

`Probe` implements the `StepObserver` protocol of `mixprec.engine`::

    probe = mixprec.doctor.Probe(model=model)   # model: needed to hunt non-finite sources
    with probe.watching(prec):                  # attaches; also watches gradient clipping
        for x, y in loader:
            ...
            prec.backward(loss)
            prec.clip_grad_norm_(model.parameters(), 1.0)
            prec.step(optimizer)
    for finding in probe.findings():
        print(finding.rule, finding.message)

On sampled steps (every `every` steps) it measures the gradients against fp16's
range (``gradient-underflow``) and whether non-zero updates changed 16-bit stored
parameters (``vanishing-updates``). On every step it follows the loss scale
(``loss-scale-collapse``). While watching, it notes clipping of still-scaled
gradients (``clip-before-unscale``). After a step with non-finite gradients it
hooks every module for a few steps to name the first one whose forward output
turned inf/NaN (``nonfinite-source``), then removes the hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.doctor.facts import resolve_mixprec_master
from mixprec.doctor.findings import Finding, sort_findings
from mixprec.doctor.hooks import ClipCall, ClipWatch, NonfiniteHit, NonfiniteHunter
from mixprec.doctor.measure import (
    GradientStats,
    ScaleEntry,
    UpdateStats,
    gradient_stats,
    judge_loss_scale,
    update_stats,
)
from mixprec.doctor.runtime_rules import (
    clip_before_unscale,
    gradient_underflow,
    loss_scale_collapse,
    nonfinite_not_in_forward,
    nonfinite_source,
    vanishing_updates,
)
from mixprec.dtypes import dtype_name, is_16bit

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["DEFAULT_EVERY", "Probe", "ProbeSample"]

#: Default sampling period, chosen with bench/doctor_overhead.py: about 3-5% of a
#: small bf16 MLP's step time on a CPU (docs/doctor.md, "Cost"); every=5 nears 10%.
DEFAULT_EVERY = 10


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


@dataclass(kw_only=True)
class _Entry:
    param: torch.Tensor
    before: torch.Tensor
    intended: torch.Tensor | None  # None: decided from the master after the step
    optimizer: torch.optim.Optimizer
    index: int
    master_before: torch.Tensor | None
    has_master: bool


@dataclass(kw_only=True)
class _Pending:
    step: int
    stats: GradientStats
    compute: str
    loss_scale: float | None
    entries: list[_Entry]


@dataclass(kw_only=True)
class _Flag:
    finding: Finding
    worst: float
    first_step: int
    last_step: int
    times: int


def _master_weights(opt: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    fn = getattr(opt, "master_weights", None)
    if not callable(fn):
        return None
    values = fn()  # mixprec.optim returns new tensors: no copy needed
    if not isinstance(values, list | tuple):
        return None
    return [v.detach() for v in values if isinstance(v, torch.Tensor)]


class Probe:
    """Runtime probes for a `Precision` run (a `StepObserver`).

    Args:
        every: sample gradients and updates every this many steps (the loss-scale
            trend is followed on every step).
        model: the model; needed to hunt ``nonfinite-source`` and to name
            parameters in evidence. Embedding parameters are left out of the
            zero-gradient count (unused rows are legitimately zero).
        underflow_threshold: report ``gradient-underflow`` in non-fp16 runs when
            at least this share of gradient elements is below fp16's smallest subnormal.
        zero_threshold: report ``gradient-underflow`` in fp16-compute runs when at
            least this share of gradient elements is exactly zero.
        vanishing_threshold: report ``vanishing-updates`` when at least this share
            of intended non-zero updates left a 16-bit parameter unchanged.
        window: steps looked at for the loss-scale trend.
        collapse_octaves: a loss scale this many binary orders below its initial
            value, with skips, has collapsed.
        falling_run: so many scale decreases in a row, with most recent steps
            skipped, is a collapse too.
        min_skips: skipped steps in the window needed for the first criterion.
        hunt_steps: how many steps the non-finite hunt keeps its hooks.
        max_hunts: at most this many hunts per run (bounds the cost when overflow
            is routine, as under dynamic loss scaling).
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
        underflow_threshold: float = 0.01,
        zero_threshold: float = 0.05,
        vanishing_threshold: float = 0.05,
        window: int = 50,
        collapse_octaves: int = 12,
        falling_run: int = 8,
        min_skips: int = 3,
        hunt_steps: int = 3,
        max_hunts: int = 3,
        max_samples: int = 1000,
        track_masters: bool = False,
    ) -> None:
        for name, value in (
            ("every", every),
            ("window", window),
            ("collapse_octaves", collapse_octaves),
            ("falling_run", falling_run),
            ("hunt_steps", hunt_steps),
            ("max_samples", max_samples),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, value in (("min_skips", min_skips), ("max_hunts", max_hunts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name, frac in (
            ("underflow_threshold", underflow_threshold),
            ("zero_threshold", zero_threshold),
            ("vanishing_threshold", vanishing_threshold),
        ):
            if not 0.0 < frac <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {frac!r}")
        self.every = every
        self.model = model
        self.underflow_threshold = underflow_threshold
        self.zero_threshold = zero_threshold
        self.vanishing_threshold = vanishing_threshold
        self.window = window
        self.collapse_octaves = collapse_octaves
        self.falling_run = falling_run
        self.min_skips = min_skips
        self.hunt_steps = hunt_steps
        self.max_hunts = max_hunts
        self.track_masters = track_masters
        self._samples: deque[ProbeSample] = deque(maxlen=max_samples)
        self._flags: dict[str, _Flag] = {}
        self._precs: list[weakref.ref[Precision]] = []
        self._pending: _Pending | None = None
        self._scales: deque[ScaleEntry] = deque(maxlen=window)
        self._init_scale: float | None = None
        self._clip = ClipWatch(self._on_clip)
        self._hunter: NonfiniteHunter | None = None
        self._hunt_watched = 0
        self._hunts = 0
        self._hunt_from: int | None = None
        self._source_found = False
        self._names: dict[int, str] | None = None
        self._embeddings: set[int] | None = None

    # ------------------------------------------------------------ attaching

    def attach(self, prec: Precision, model: nn.Module | None = None) -> Probe:
        """Observe `prec`'s steps and watch gradient clipping until `detach`.

        Args:
            prec: the run to observe.
            model: the model (replaces the constructor's `model` when given).
        """
        if model is not None:
            self.model = model
            self._names = self._embeddings = None
        if self not in prec.observers:
            prec.add_observer(self)
        self._see(prec)
        self._clip.install()
        return self

    def detach(self, prec: Precision | None = None) -> None:
        """Stop observing (`prec`, or every run seen), restore the clipping functions
        and remove any hooks."""
        precs = [prec] if prec is not None else self._live_precs()
        for p in precs:
            if self in p.observers:
                p.remove_observer(self)
        self._clip.uninstall()
        self._stop_hunt()

    @contextlib.contextmanager
    def watching(self, prec: Precision | None = None) -> Iterator[Probe]:
        """A context that watches clipping calls (and attaches to `prec` if given),
        restoring everything on exit.

        Without `prec`, the probe must be added with ``prec.add_observer(probe)``; it
        then learns the run at its first step, so clipping before that step is
        not judged.
        """
        added = prec is not None and self not in prec.observers
        if prec is not None:
            if added:
                prec.add_observer(self)
            self._see(prec)
        self._clip.install()
        try:
            yield self
        finally:
            self._clip.uninstall()
            self._stop_hunt()
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
        out = []
        for flag in self._flags.values():
            evidence = {
                **flag.finding.evidence,
                "first_step": flag.first_step,
                "last_step": flag.last_step,
                "times_seen": flag.times,
            }
            out.append(dataclasses.replace(flag.finding, evidence=evidence))
        return sort_findings(out)

    def _record(self, step: int, value: float, finding: Finding) -> None:
        """Keep the worst finding of each rule (largest `value`), counting occurrences."""
        flag = self._flags.get(finding.rule)
        if flag is None:
            self._flags[finding.rule] = _Flag(
                finding=finding, worst=value, first_step=step, last_step=step, times=1
            )
            return
        flag.last_step = step
        flag.times += 1
        if value > flag.worst:
            flag.worst = value
            flag.finding = finding

    def _name(self, param: torch.Tensor) -> str | None:
        if self.model is None:
            return None
        if self._names is None:
            self._names = {id(p): n for n, p in self.model.named_parameters()}
        return self._names.get(id(param))

    def _embedding_ids(self) -> set[int]:
        if self.model is None:
            return set()
        if self._embeddings is None:
            self._embeddings = {
                id(p)
                for m in self.model.modules()
                if isinstance(m, nn.Embedding | nn.EmbeddingBag)
                for p in m.parameters(recurse=False)
            }
        return self._embeddings

    # ------------------------------------------------------ observer hooks

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Sample gradients (final, unscaled) and snapshot 16-bit parameters."""
        self._see(prec)
        self._pending = None
        if step % self.every != 0:
            return
        skip = self._embedding_ids()
        grads = [
            p.grad
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in skip
        ]
        stats = gradient_stats(g for g in grads if g is not None)
        compute = prec.policy.effective_compute_dtype
        self._judge_gradients(prec, step, stats, compute)
        entries: list[_Entry] = []
        with torch.no_grad():
            for opt in optimizers:
                entries += self._snapshot(opt)
        self._pending = _Pending(
            step=step,
            stats=stats,
            compute=dtype_name(compute),
            loss_scale=prec.loss_scale,
            entries=entries,
        )

    def _snapshot(self, opt: torch.optim.Optimizer) -> list[_Entry]:
        mixprec = type(opt).__module__.startswith("mixprec.optim")
        wants_master = (
            self.track_masters
            and mixprec
            and any(
                resolve_mixprec_master(str(g.get("master", "none")), p.dtype) != "none"
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None and is_16bit(p.dtype)
            )
        )
        masters = _master_weights(opt) if wants_master else None
        entries = []
        index = -1
        for group in opt.param_groups:
            requested = str(group.get("master", "none"))
            for p in group["params"]:
                index += 1
                if p.grad is None or not is_16bit(p.dtype):
                    continue
                has_master = mixprec and resolve_mixprec_master(requested, p.dtype) != "none"
                master_before: torch.Tensor | None = None
                intended: torch.Tensor | None = None
                if has_master and masters is not None and index < len(masters):
                    master_before = masters[index]
                else:
                    intended = p.grad != 0
                entries.append(
                    _Entry(
                        param=p,
                        before=p.detach().clone(),
                        intended=intended,
                        optimizer=opt,
                        index=index,
                        master_before=master_before,
                        has_master=has_master,
                    )
                )
        return entries

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Follow the loss scale, finish the sampled measurements, run the hunt."""
        self._see(prec)
        if report.scale is not None and report.next_scale is not None:
            self._follow_scale(prec, report)
        pending, self._pending = self._pending, None
        if pending is not None and pending.step == report.step:
            self._finish_sample(prec, pending, report)
        self._hunt(prec, report)

    # ----------------------------------------------------------- gradients

    def _judge_gradients(
        self, prec: Precision, step: int, stats: GradientStats, compute: torch.dtype
    ) -> None:
        policy = prec.policy
        finding = gradient_underflow(
            stats,
            step=step,
            compute=compute,
            scales=policy.scales_loss,
            loss_scale=prec.loss_scale,
            fp16_in_use=torch.float16 in (policy.reduce_dtype, policy.param_dtype),
            zero_threshold=self.zero_threshold,
            underflow_threshold=self.underflow_threshold,
        )
        if finding is not None:
            value = stats.zero_fraction if compute == torch.float16 else stats.underflow_fraction
            self._record(step, value, finding)

    # ------------------------------------------------------------- updates

    def _finish_sample(self, prec: Precision, pending: _Pending, report: StepReport) -> None:
        updates: UpdateStats | None = None
        master_updates: UpdateStats | None = None
        worst: tuple[float, _Entry] | None = None
        dtypes: set[str] = set()
        if report.applied and pending.entries:
            after_masters: dict[int, list[torch.Tensor] | None] = {}
            with torch.no_grad():
                for e in pending.entries:
                    after = e.param.detach()
                    dtypes.add(dtype_name(after.dtype))
                    if e.intended is not None:
                        u = update_stats(e.before, after, e.intended)
                        if e.has_master:  # the master keeps these updates
                            master_updates = u if master_updates is None else master_updates + u
                            continue
                        updates = u if updates is None else updates + u
                        if u.intended and (worst is None or u.fraction > worst[0]):
                            worst = (u.fraction, e)
                        continue
                    key = id(e.optimizer)
                    if key not in after_masters:
                        after_masters[key] = _master_weights(e.optimizer)
                    masters = after_masters[key]
                    if masters is None or e.master_before is None or e.index >= len(masters):
                        continue
                    intended = masters[e.index] != e.master_before
                    u = update_stats(e.before, after, intended)
                    master_updates = u if master_updates is None else master_updates + u
        self._samples.append(
            ProbeSample(
                step=pending.step,
                compute_dtype=pending.compute,
                loss_scale=pending.loss_scale,
                grads=pending.stats,
                updates=updates,
                master_updates=master_updates,
                applied=report.applied,
            )
        )
        if updates is None or worst is None:
            return
        entry = worst[1]
        where = (
            self._name(entry.param)
            or f"parameter {entry.index} of {type(entry.optimizer).__name__}"
        )
        finding = vanishing_updates(
            updates,
            step=pending.step,
            where=where,
            dtype=entry.param.dtype,
            worst_fraction=worst[0],
            param_dtypes=sorted(dtypes),
            master_updates=master_updates,
            threshold=self.vanishing_threshold,
        )
        if finding is not None:
            self._record(pending.step, updates.fraction, finding)

    # ---------------------------------------------------------- loss scale

    def _follow_scale(self, prec: Precision, report: StepReport) -> None:
        assert report.scale is not None and report.next_scale is not None
        self._scales.append(
            ScaleEntry(
                step=report.step,
                scale=report.scale,
                next_scale=report.next_scale,
                applied=report.applied,
            )
        )
        if self._init_scale is None:
            self._init_scale = report.scale
        verdict = judge_loss_scale(
            list(self._scales),
            init_scale=self._init_scale,
            window=self.window,
            collapse_octaves=self.collapse_octaves,
            falling_run=self.falling_run,
            min_skips=self.min_skips,
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
        self._record(report.step, verdict.octaves_below_init, finding)

    # ------------------------------------------------------------ clipping

    def _on_clip(self, call: ClipCall) -> None:
        for prec in self._live_precs():
            if prec.gradients_are_scaled:
                step = prec.stats.steps
                self._record(
                    step, 0.0, clip_before_unscale(call, step=step, loss_scale=prec.loss_scale)
                )
                return

    # ---------------------------------------------------------- non-finite

    def _stop_hunt(self) -> None:
        if self._hunter is not None:
            self._hunter.remove()
            self._hunter = None

    def _hunt(self, prec: Precision, report: StepReport) -> None:
        if self._hunter is not None:
            self._hunt_watched += 1
            hit = self._hunter.hit
            if hit is not None:
                self._stop_hunt()
                self._source_found = True
                self._report_source(prec, report.step, hit)
            elif self._hunt_watched >= self.hunt_steps:
                self._stop_hunt()
                if not prec.policy.scales_loss:
                    self._report_no_source(report.step)
            return
        if report.nonfinite_grads <= 0:
            return
        if self._hunt_from is None:
            self._hunt_from = report.step
        if self.model is None or self._source_found or self._hunts >= self.max_hunts:
            return
        self._hunter = NonfiniteHunter(self.model)
        self._hunter.install()
        self._hunts += 1
        self._hunt_watched = 0

    def _report_source(self, prec: Precision, step: int, hit: NonfiniteHit) -> None:
        finding = nonfinite_source(
            hit,
            step=step,
            first_nonfinite_step=self._hunt_from,
            compute=prec.policy.effective_compute_dtype,
        )
        self._record(step, 1.0, finding)

    def _report_no_source(self, step: int) -> None:
        finding = nonfinite_not_in_forward(
            first_nonfinite_step=self._hunt_from, steps_watched=self.hunt_steps
        )
        self._record(step, 0.0, finding)
