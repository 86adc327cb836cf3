"""``vanishing-updates``: non-zero updates that left 16-bit parameters unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.facts import resolve_mixprec_master
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.measure import UpdateStats, update_stats
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.rules import vanishing_updates
from mixprec.doctor.runtime.schedule import SampleSchedule
from mixprec.doctor.runtime.thresholds import ProbeThresholds
from mixprec.dtypes import dtype_name, is_16bit
from mixprec.engine.optimizers import unwrapped

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["UpdateObserver", "UpdateSample"]


@dataclass(frozen=True, kw_only=True)
class UpdateSample:
    """The updates of one sampled, applied step.

    Attributes:
        step: the step index.
        updates: 16-bit parameters without a master (None when there were none).
        master_updates: 16-bit parameters with a master (None when there were none).
    """

    step: int
    updates: UpdateStats | None
    master_updates: UpdateStats | None


@dataclass(kw_only=True)
class _Entry:
    param: torch.Tensor
    before: torch.Tensor
    intended: torch.Tensor | None  # None: decided from the master after the step
    optimizer: torch.optim.Optimizer
    index: int
    master_before: torch.Tensor | None
    has_master: bool


def _master_weights(opt: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    fn = getattr(unwrapped(opt), "master_weights", None)
    if not callable(fn):
        return None
    values = fn()  # mixprec.optim returns new tensors: no copy needed
    if not isinstance(values, list | tuple):
        return None
    return [v.detach() for v in values if isinstance(v, torch.Tensor)]


def _optimizer_name(opt: torch.optim.Optimizer) -> str:
    """``torch.optim.SGD`` for torch's (whatever submodule defines it), else module.class."""
    cls = type(unwrapped(opt))
    top = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"{top}.{cls.__name__}"


class UpdateObserver:
    """A `StepObserver` that compares 16-bit parameters before and after each sampled
    step.

    The intent of an update is "the gradient is non-zero"; with `track_masters`,
    for `mixprec.optim` optimizers with a master it is "the master value changed"
    (exact, but it reconstructs every master twice per sampled step with
    ``master_weights()``, which can cost more than a step).

    Args:
        ledger: where findings go.
        thresholds: ``vanishing_threshold`` is read.
        index: the model's parameters (to name the worst one).
        schedule: which steps are sampled.
        track_masters: see above.
    """

    def __init__(
        self,
        *,
        ledger: FindingLedger,
        thresholds: ProbeThresholds,
        index: ModelIndex,
        schedule: SampleSchedule,
        track_masters: bool = False,
    ) -> None:
        self._ledger = ledger
        self._thresholds = thresholds
        self._index = index
        self.schedule = schedule
        self.track_masters = track_masters
        self._pending: tuple[int, list[_Entry]] | None = None
        self._latest: UpdateSample | None = None

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Snapshot the 16-bit parameters on a sampled step."""
        self._pending = None
        self._latest = None
        if not self.schedule.is_sampled(step):
            return
        entries: list[_Entry] = []
        with torch.no_grad():
            for opt in optimizers:
                entries += self._snapshot(opt)
        self._pending = (step, entries)

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
        """Compare the snapshot with the stored values and judge the lost updates."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != report.step:
            return
        step, entries = pending
        updates: UpdateStats | None = None
        master_updates: UpdateStats | None = None
        worst: tuple[float, _Entry] | None = None
        dtypes: set[str] = set()
        if report.applied and entries:
            after_masters: dict[int, list[torch.Tensor] | None] = {}
            with torch.no_grad():
                for e in entries:
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
        self._latest = UpdateSample(step=step, updates=updates, master_updates=master_updates)
        if updates is None or worst is None:
            return
        entry = worst[1]
        where = (
            self._index.name(entry.param)
            or f"parameter {entry.index} of {type(entry.optimizer).__name__}"
        )
        finding = vanishing_updates(
            updates,
            step=step,
            where=where,
            dtype=entry.param.dtype,
            worst_fraction=worst[0],
            param_dtypes=sorted(dtypes),
            master_updates=master_updates,
            threshold=self._thresholds.vanishing_threshold,
            optimizer=_optimizer_name(entry.optimizer),
        )
        if finding is not None:
            self._ledger.record(step, updates.fraction, finding)

    def take(self, step: int) -> UpdateSample | None:
        """The updates of `step` if it was sampled (once: they are then forgotten)."""
        latest, self._latest = self._latest, None
        return latest if latest is not None and latest.step == step else None
