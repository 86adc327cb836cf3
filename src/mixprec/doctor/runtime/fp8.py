"""``fp8-saturation``, ``fp8-underflow``: what the fp8 casts of each fp8 layer clip and flush.

Once the probe has decided the next step is sampled, `Fp8Observer.arm_next` adds,
on each torchao ``Float8Linear`` of the model, a forward pre-hook that measures the
layer's weight and input as torchao casts them and, on the output, a tensor hook
that measures the gradient arriving from the loss (the tensor torchao casts in
backward). Each measurement is `fp8_measure.cast_counts` under the scale torchao
computes (`current_scale`) and, as a what-if, under Transformer Engine's delayed
scale from the tensor's amax history (`delayed_scale`). Counts stay on the device
until `before_step` reads them back in one transfer, records the amax history,
judges, and removes the hooks. The hooks read tensors and return None: the run's
numerics are untouched. Their time is charged to the probe's budget.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from mixprec.doctor.runtime.fp8_layers import CastPlan, Fp8Layer, Role, fp8_layers
from mixprec.doctor.runtime.fp8_measure import (
    AmaxAlgo,
    Fp8CastRecord,
    Fp8CastStats,
    Fp8TensorSample,
    cast_counts,
    current_scale,
    delayed_scale,
    fp8_limits,
)
from mixprec.doctor.runtime.fp8_rules import fp8_not_accelerated, fp8_saturation, fp8_underflow
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.model_index import ModelIndex
from mixprec.doctor.runtime.reference import is_replaying
from mixprec.doctor.runtime.schedule import SampleSchedule
from mixprec.doctor.runtime.thresholds import ProbeThresholds

if TYPE_CHECKING:
    from mixprec.engine import Precision, StepReport

__all__ = ["Fp8Observer"]


@dataclass(kw_only=True)
class _Pending:
    """One tensor's measurements of the armed step, on the device."""

    layer: Fp8Layer
    role: Role
    rows: list[list[torch.Tensor]]  # per cast, one row per forward/backward seen
    delayed_rows: list[torch.Tensor]
    delayed_scale: float | None


def _view_2d(x: torch.Tensor, role: Role) -> torch.Tensor:
    return x if role == "weight" else x.reshape(-1, x.shape[-1])


def _measure(x: torch.Tensor, plan: CastPlan) -> torch.Tensor:
    """`cast_counts` of `x` under the scale torchao computes for `plan`."""
    limits = fp8_limits(plan.dtype)
    x2 = _view_2d(x.detach(), plan.role)
    if plan.reduce_dim is None:
        amax = x2.abs().amax().to(torch.float32)
    else:
        amax = x2.abs().amax(dim=plan.reduce_dim, keepdim=True).to(torch.float32)
    return cast_counts(
        x2, current_scale(amax, fp8_max=limits.max, round_pow2=plan.round_pow2), limits
    )


def _combine(rows: list[torch.Tensor]) -> list[float]:
    """Several passes of one cast (gradient accumulation): counts add, amax is the max,
    scales the extremes."""
    table = torch.stack(rows)
    return [
        *table[:, :4].sum(dim=0).tolist(),
        float(table[:, 4].max()),
        float(table[:, 5].min()),
        float(table[:, 6].max()),
    ]


class Fp8Observer:
    """A `StepObserver` that measures the fp8 casts of a model's fp8 layers on sampled steps.

    Args:
        ledger: where findings go.
        thresholds: ``fp8_saturation_threshold``, ``fp8_underflow_threshold``,
            ``fp8_amax_history_len``, ``fp8_margin``, ``fp8_amax_compute_algo``.
        index: the model (nothing is measured without one).
        schedule: which steps are sampled; the hooks' time is charged to it.
    """

    def __init__(
        self,
        *,
        ledger: FindingLedger,
        thresholds: ProbeThresholds,
        index: ModelIndex,
        schedule: SampleSchedule,
    ) -> None:
        self._ledger = ledger
        self._thresholds = thresholds
        self._index = index
        self.schedule = schedule
        self._layers: tuple[Fp8Layer, ...] = ()
        self._layers_of: nn.Module | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending: dict[tuple[str, Role], _Pending] = {}
        self._armed_step: int | None = None
        self._hook_s = 0.0
        self._history: dict[tuple[str, Role], deque[float]] = {}
        self._sampled: dict[tuple[str, Role], int] = {}
        self._device_judged = False
        self._latest: tuple[int, tuple[Fp8TensorSample, ...]] | None = None

    # ------------------------------------------------------------------ layers

    def layers(self) -> tuple[Fp8Layer, ...]:
        """The fp8 layers of the probe's model (found once per model)."""
        model = self._index.model
        if model is not self._layers_of:
            self._layers_of = model
            self._layers = fp8_layers(model)
        return self._layers

    @property
    def amax_history(self) -> dict[str, tuple[float, ...]]:
        """The amax history of each fp8 tensor (``"layer (role)"``), oldest first."""
        return {f"{k[0]} ({k[1]})": tuple(v) for k, v in self._history.items()}

    # ------------------------------------------------------------------- hooks

    def arm_next(self, prec: Precision, step: int) -> None:
        """Hook the fp8 layers for `step` if it is sampled."""
        del prec
        layers = self.layers()
        if not layers or not self.schedule.is_sampled(step):
            self.stop()
            return
        if self._armed_step == step and self._handles:
            return
        self.stop()
        self._armed_step = step
        t = self._thresholds
        algo = cast(AmaxAlgo, t.fp8_amax_compute_algo)
        for layer in layers:
            for role in ("weight", "input", "grad_output"):
                plans = layer.casts_of(role)
                if not plans:
                    continue
                history = self._history.get((layer.name, role), ())
                scale = delayed_scale(
                    list(history),
                    fp8_max=fp8_limits(plans[0].dtype).max,
                    margin=t.fp8_margin,
                    algo=algo,
                )
                self._pending[(layer.name, role)] = _Pending(
                    layer=layer,
                    role=role,
                    rows=[[] for _ in plans],
                    delayed_rows=[],
                    delayed_scale=scale,
                )
            hook = functools.partial(self._forward_pre, layer)
            self._handles.append(layer.module.register_forward_pre_hook(hook))
            out_hook = functools.partial(self._forward_post, layer)
            self._handles.append(layer.module.register_forward_hook(out_hook))

    def _take(self, layer: Fp8Layer, role: Role, x: torch.Tensor) -> None:
        pending = self._pending.get((layer.name, role))
        # A fake-tensor pass (memory.estimate's forward, torch.compile tracing) has no
        # values: it is not the run, and reading its counts back would raise.
        if pending is None or is_fake(x):
            return
        with torch.no_grad():
            for plan, rows in zip(layer.casts_of(role), pending.rows, strict=True):
                rows.append(_measure(x, plan))
            if pending.delayed_scale is not None:
                limits = fp8_limits(layer.casts_of(role)[0].dtype)
                x2 = _view_2d(x.detach(), role)
                pending.delayed_rows.append(cast_counts(x2, pending.delayed_scale, limits))

    def _forward_pre(self, layer: Fp8Layer, module: nn.Module, args: Any) -> None:
        if is_replaying() or not torch.is_grad_enabled():
            return
        since = self.schedule.clock()
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and is_fake(x):
            return  # the weight too: under fake mode its counts would come back fake
        if x is not None:
            # What Float8Linear.forward does before casting (torchao 0.18).
            if torch.is_autocast_enabled():
                x = x.to(torch.get_autocast_dtype("cuda"))
            self._take(layer, "input", x)
        weight = getattr(module, "weight", None)
        pending = self._pending.get((layer.name, "weight"))
        if isinstance(weight, torch.Tensor) and pending is not None and not pending.rows[0]:
            self._take(layer, "weight", weight)  # once per step: the same weight each forward
        self._hook_s += max(self.schedule.clock() - since, 0.0)

    def _forward_post(self, layer: Fp8Layer, module: nn.Module, args: Any, output: Any) -> None:
        del module, args
        if is_replaying() or not torch.is_grad_enabled():
            return
        if (layer.name, "grad_output") not in self._pending:
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, layer))  # type: ignore[no-untyped-call]

    def _grad_hook(self, layer: Fp8Layer, grad: torch.Tensor) -> None:
        since = self.schedule.clock()
        self._take(layer, "grad_output", grad)
        self._hook_s += max(self.schedule.clock() - since, 0.0)

    def stop(self) -> None:
        """Remove the hooks and drop what they measured."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self._armed_step = None

    # ------------------------------------------------------------------ steps

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Read back the sampled step's measurements and judge them."""
        del optimizers
        self._latest = None
        hook_s, self._hook_s = self._hook_s, 0.0
        self.schedule.charge_seconds(hook_s)
        if not self.schedule.is_sampled(step) or self._armed_step != step:
            self.stop()
            return
        pending = [p for p in self._pending.values() if any(p.rows)]
        self.stop()
        if not pending:
            return
        self._judge_device(prec)
        tensors = [self._sample(p, step) for p in pending]
        self._latest = (step, tuple(tensors))
        t = self._thresholds
        found = fp8_saturation(
            tensors,
            step=step,
            threshold=t.fp8_saturation_threshold,
            history_len=t.fp8_amax_history_len,
            margin=t.fp8_margin,
            algo=t.fp8_amax_compute_algo,
        )
        if found is not None:
            self._ledger.record(step, float(found.evidence["fraction"]), found)
        found = fp8_underflow(tensors, step=step, threshold=t.fp8_underflow_threshold)
        if found is not None:
            self._ledger.record(step, float(found.evidence["fraction"]), found)

    def _sample(self, pending: _Pending, step: int) -> Fp8TensorSample:
        layer, role = pending.layer, pending.role
        plans = layer.casts_of(role)
        casts = tuple(
            Fp8CastRecord(
                gemms=plan.gemms,
                granularity=plan.granularity,
                stats=Fp8CastStats.from_row(_combine(rows)),
            )
            for plan, rows in zip(plans, pending.rows, strict=True)
            if rows
        )
        delayed = (
            Fp8CastStats.from_row(_combine(pending.delayed_rows)) if pending.delayed_rows else None
        )
        key = (layer.name, role)
        history = self._history.setdefault(key, deque(maxlen=self._thresholds.fp8_amax_history_len))
        amax = max(c.stats.amax for c in casts)
        history.append(amax)
        self._sampled[key] = self._sampled.get(key, 0) + 1
        return Fp8TensorSample(
            step=step,
            layer=layer.name,
            role=role,
            format=fp8_limits(plans[0].dtype).name,
            recipe=layer.recipe,
            casts=casts,
            delayed=delayed,
            delayed_scale=pending.delayed_scale if delayed is not None else None,
            history=tuple(history),
            samples=self._sampled[key],
        )

    def _judge_device(self, prec: Precision) -> None:
        """``format-not-accelerated`` once per run, from the first fp8 layer's device."""
        del prec
        if self._device_judged:
            return
        self._device_judged = True
        from mixprec.device import device_caps

        layers = self.layers()
        weight = getattr(layers[0].module, "weight", None)
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        caps = device_caps(device)
        found = fp8_not_accelerated(
            layers=[la.name for la in layers],
            emulated=[la.name for la in layers if la.emulate],
            device=caps.name,
            fp8_fast=caps.fast("fp8"),
            reason=caps.reason("fp8"),
        )
        if found is not None:
            self._ledger.record(0, 0.0, found)

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """Nothing: the casts are judged before the update."""

    def take(self, step: int) -> tuple[Fp8TensorSample, ...]:
        """The fp8 tensors sampled on `step` (once: then forgotten)."""
        latest, self._latest = self._latest, None
        return latest[1] if latest is not None and latest[0] == step else ()
