"""mixprec inside Lightning: a precision plugin for the `Trainer` and one for `Fabric`.

    prec = mixprec.Precision("bf16_master")
    trainer = lightning.Trainer(plugins=[MixprecPrecision(prec)], gradient_clip_val=1.0)

    # in the LightningModule: build the optimizer through the same Precision
    def configure_optimizers(self):
        return prec.optimizer(self, lr=1e-3)

Each Lightning precision hook is the matching `Precision` call, so a run under
the plugin is the README loop: ``convert_module`` is `Precision.prepare` (storage,
fp32 islands), ``forward_context`` is `Precision.autocast`, ``backward`` is
`Precision.backward` (the loss scale), gradient clipping by norm is
`Precision.clip_grad_norm_` (true gradients), and ``optimizer_step`` runs the
closure and then `Precision.step`, which skips a non-finite update. A skipped
step also holds the learning-rate schedulers back (they are wrapped in
`HeldScheduler` when the plugin connects). `MixprecPrecision.last_report` is the
last `StepReport`; `step_metrics` (steps applied and skipped, the loss scale, the
doctor's findings) goes to the module's loggers after each step.
The plugin's state (the loss scaler and the step telemetry) is saved in
Lightning's checkpoints and restored on resume.

Lightning's own ``precision=`` flag and a plugin together are refused by
Lightning itself ("Received both `precision=...` and `plugins=...`").
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.fabric.plugins.precision as fabric_precision
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from mixprec.engine import Precision, StepReport
from mixprec.errors import PrecisionError
from mixprec.integrations.metrics import step_metrics

__all__ = ["HeldScheduler", "MixprecFabricPrecision", "MixprecPrecision"]


def _precision(prec: Precision | str) -> Precision:
    if isinstance(prec, str):
        return Precision(prec)
    if not isinstance(prec, Precision):
        raise TypeError(
            f"give a mixprec.Precision or a policy name, got {type(prec).__name__}: {prec!r}"
        )
    return prec


class HeldScheduler:
    """A learning-rate scheduler that does not advance on a step `Precision` skipped.

    Wraps the scheduler Lightning holds (``LRSchedulerConfig.scheduler``); every other
    attribute, and the state dict, are the wrapped scheduler's own, so checkpoints are
    what they would be without the plugin.
    """

    def __init__(self, scheduler: Any, plugin: MixprecPrecision) -> None:
        self.scheduler = scheduler
        self._plugin = plugin

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless the last optimizer step was skipped."""
        report = self._plugin.last_report
        if report is None or report.applied:
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state dict."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


class MixprecPrecision(TrainerPrecision):
    """The Lightning `Trainer` plugin (see the module docs).

    Args:
        prec: the run's `Precision`, or a policy name to build one from; the
            LightningModule's ``configure_optimizers`` builds its optimizer with
            ``prec.optimizer(self, ...)`` (another optimizer is checked against the
            policy when the plugin connects and refused if it cannot keep its master).
    """

    precision = "32-true"  # Lightning's own label; the policy decides what runs

    def __init__(self, prec: Precision | str) -> None:
        self.prec = _precision(prec)
        #: The last step's `StepReport` (None before the first step).
        self.last_report: StepReport | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """`Precision.prepare`: the policy's storage and fp32 islands."""
        return self.prec.prepare(module)

    def connect(
        self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Any], list[Any]]:
        """Check the optimizers against the policy and hold the schedulers on skips."""
        for optimizer in optimizers:
            self.prec.register(optimizer)
        self.prec.check_optimizers(optimizers)
        for config in lr_schedulers:
            if not isinstance(config.scheduler, HeldScheduler):
                config.scheduler = HeldScheduler(config.scheduler, self)
        return model, optimizers, lr_schedulers

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """`Precision.autocast`."""
        with self.prec.autocast():
            yield

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """`Precision.backward` (the loss scale, when the policy has one)."""
        if args:
            raise TypeError(f"{type(self).__name__}: give backward's options by keyword")
        self.prec.backward(tensor, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training step, backward), clip, then `Precision.step`."""
        if kwargs:
            raise PrecisionError(
                f"MixprecPrecision: optimizer_step got {sorted(kwargs)}; Precision.step takes "
                "no optimizer arguments"
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: Lightning skips backward and step
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, clipping
        self.last_report = self.prec.step(optimizer)
        if model.automatic_optimization and model._trainer is not None:
            model.log_dict(step_metrics(self.prec), on_step=True, on_epoch=False, batch_size=1)
        return closure_result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the true (unscaled) gradients: by norm through `Precision.clip_grad_norm_`,
        by value after `Precision.unscale_`."""
        if clip_val <= 0:
            return
        # manual optimization hands over the LightningOptimizer wrapper; its step reaches
        # Precision.step with the optimizer it wraps, which must be the one unscaled here
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.prec.unscale_(optimizer)
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            self.prec.clip_grad_norm_(params, float(clip_val), optimizer=optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler and step telemetry (`Precision.state_dict`)."""
        return self.prec.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict` (the policy must be the same)."""
        self.prec.load_state_dict(state_dict)


class MixprecFabricPrecision(fabric_precision.Precision):
    """The `Fabric` plugin: ``Fabric(plugins=[MixprecFabricPrecision(prec)])``.

    ``fabric.setup(model, optimizer)`` prepares the model (build the optimizer with
    ``prec.optimizer(model)`` after ``fabric.setup_module(model)``, or prepare first:
    ``prec.prepare`` is idempotent); ``fabric.backward(loss)`` is `Precision.backward`;
    ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips true gradients;
    ``optimizer.step()`` is `Precision.step` and `last_report` is its `StepReport`.
    The loss scaler is in ``fabric.save``'s state when the state holds the plugin
    (``state = {"model": ..., "optimizer": ..., "precision": plugin}``); ``fabric.load``
    gives it back.
    """

    precision = "32-true"

    def __init__(self, prec: Precision | str) -> None:
        self.prec = _precision(prec)
        #: The last step's `StepReport` (None before the first step).
        self.last_report: StepReport | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """`Precision.prepare`."""
        return self.prec.prepare(module)

    def forward_context(self) -> Any:
        """`Precision.autocast`."""
        return self.prec.autocast()

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        """`Precision.backward`."""
        if args:
            raise TypeError(f"{type(self).__name__}: give backward's options by keyword")
        self.prec.backward(tensor, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """`Precision.step` (a non-finite update is skipped)."""
        if kwargs:
            raise PrecisionError(
                f"MixprecFabricPrecision: optimizer.step got {sorted(kwargs)}; Precision.step "
                "takes no optimizer arguments"
            )
        self.last_report = self.prec.step(optimizer)
        return None

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """`Precision.unscale_`: Fabric calls it before its own gradient clipping."""
        self.prec.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler and step telemetry (`Precision.state_dict`)."""
        return self.prec.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`."""
        self.prec.load_state_dict(state_dict)
