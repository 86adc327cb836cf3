"""mixprec inside `transformers.Trainer`, and the trainers that subclass it (TRL's).

``PrecisionTrainer(model=..., args=..., precision="bf16_master")`` trains exactly
as mixprec's own loop does (`Precision.prepare`, `optimizer`, `autocast`,
`backward`, `clip_grad_norm_`, `step`), through the trainer's own settings:
`max_grad_norm` clips the true gradients, a skipped step holds the LR scheduler
back, the precision state travels in the trainer's checkpoints, and the
run's telemetry is in the trainer's logs. `PrecisionTrainerMixin` does the
same for any `Trainer` subclass: ``class SFT(PrecisionTrainerMixin, SFTTrainer)``.

Hooks used (docs/integrations/hf.md), tested with transformers 5.24 and accelerate 1.15
(and TRL 1.16's `SFTTrainer`):
public `Trainer` methods `create_accelerator_and_postprocess`, `create_optimizer`,
`autocast_smart_context_manager` and `log`; the private `Trainer` methods
`_clip_grad_norm`, `_get_grad_norm`, `_save_scaler`, `_load_scaler` and
`_load_from_checkpoint`; accelerate's `AcceleratedOptimizer` (its `step_was_skipped`
is what the trainer asks before stepping the scheduler) and its
`_is_accelerate_prepared` mark; the trainer's own `Accelerator`'s `backward`,
replaced on that one instance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from torch import nn
from transformers import Trainer, TrainingArguments

from mixprec.engine import Precision, StepReport
from mixprec.engine.release import refuse_trainer
from mixprec.errors import PrecisionError
from mixprec.integrations.metrics import step_metrics
from mixprec.policy import Policy

__all__ = [
    "PRECISION_STATE_NAME",
    "PRIVATE_HOOKS",
    "PrecisionOptimizer",
    "PrecisionTrainer",
    "PrecisionTrainerMixin",
    "check_arguments",
    "check_trainer_hooks",
]

#: The file that holds `Precision.state_dict()` in each checkpoint folder.
PRECISION_STATE_NAME = "precision.pt"

#: The private `Trainer` methods this module overrides (a version without one would
#: silently bypass it, so importing this module refuses it).
PRIVATE_HOOKS = (
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_scaler",
    "_load_scaler",
    "_load_from_checkpoint",
)

#: `TrainingArguments.optim` values whose optimizer is the policy's `mixprec.optim.AdamW`.
_ADAMW = ("adamw_torch", "adamw_torch_fused")


def check_trainer_hooks(trainer_cls: type) -> None:
    """Raise `ImportError` if `trainer_cls` lacks a private method this module overrides."""
    for name in PRIVATE_HOOKS:
        if not callable(getattr(trainer_cls, name, None)):
            raise ImportError(
                f"mixprec.integrations.hf overrides Trainer.{name}, which transformers "
                f"{transformers.__version__} does not have: install transformers>=5.24,<6 "
                f"(the versions it is tested with)"
            )


check_trainer_hooks(Trainer)


def check_arguments(args: TrainingArguments, precision: Precision) -> None:
    """Refuse trainer settings that contradict the policy or that it cannot run under.

    Raises:
        ValueError: one line naming the setting, the policy and the fix.
    """
    name = precision.policy.name
    half = [
        f"{field}=True"
        for field in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")
        if getattr(args, field, False)
    ]
    if half:
        # Named by the arguments' own class: TRL's SFTConfig (and its other configs)
        # turn bf16 on by default, so the fix is to set it False, not to leave it.
        raise ValueError(
            f"{type(args).__name__}({', '.join(half)}) contradicts the mixprec policy "
            f"{name!r}, which sets the precision itself: set fp16=False and bf16=False"
        )
    if args.mixed_precision != "no":
        raise ValueError(
            f"the environment sets ACCELERATE_MIXED_PRECISION={args.mixed_precision}, which "
            f"contradicts the mixprec policy {name!r} (it sets the precision itself): unset "
            "it, or launch without --mixed_precision"
        )
    if args.deepspeed or args.fsdp:
        kind = "deepspeed" if args.deepspeed else "fsdp"
        raise ValueError(
            f"TrainingArguments({kind}=...) is not supported with a mixprec policy: "
            "DeepSpeed and Accelerate's FSDP step their own optimizer; train without it"
        )


if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class PrecisionOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """The trainer's optimizer: steps through `Precision.step` and says when it skipped.

    Accelerate wraps an optimizer in `AcceleratedOptimizer`; this one is that
    wrapper already (marked prepared, so it is not wrapped twice), with `step`
    going through the `Precision` and `step_was_skipped` read from its report,
    which is what the trainer asks before stepping the LR scheduler.

    Attributes:
        precision: the run's `Precision`.
        report: the `StepReport` of the last step, None before the first.
    """

    _is_accelerate_prepared = True

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.precision = precision
        self.report: StepReport | None = None

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """`Precision.step` on the wrapped optimizer, once per gradient-accumulation cycle."""
        if self.gradient_state.sync_gradients:
            self.report = self.precision.step(self.optimizer, closure)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (non-finite gradients)."""
        return self.report is not None and self.report.skipped


class PrecisionTrainerMixin(_TrainerBase):
    """Run a `transformers.Trainer` (or a subclass) under a mixprec policy.

    Put it first among the bases: ``class MyTrainer(PrecisionTrainerMixin, SFTTrainer)``.
    It takes one keyword more than the trainer, `precision`: a `Precision`, a
    `Policy` or a preset name. The model is prepared when the trainer is built.

    Raises:
        ValueError: trainer settings the policy contradicts (`check_arguments`),
            or an ``optim`` other than AdamW without an optimizer of your own.
    """

    precision: Precision

    def __init__(self, *args: Any, precision: Precision | Policy | str, **kwargs: Any) -> None:
        # Set before the trainer's __init__, which builds the accelerator through us.
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        refuse_trainer(self.precision.policy, "PrecisionTrainer")
        super().__init__(*args, **kwargs)
        check_arguments(self.args, self.precision)
        if self.model is None or self.model_init is not None:
            raise ValueError(
                "PrecisionTrainer needs model=...: model_init is not supported (a model it "
                "makes at train() would not be prepared); build the model first"
            )
        self.model = self.model_wrapped = self.precision.prepare(self.model)

    def _prepared_model(self) -> nn.Module:
        assert self.model is not None  # refused in __init__
        return self.model

    # -- forward and backward

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The trainer calls `self.accelerator.backward(loss)`; with mixed_precision "no"
        # that is `loss.backward()`. Route it (on this trainer's accelerator only)
        # through `Precision.backward`, which scales the loss when the policy does.
        self.accelerator.backward = self._precision_backward

    def _precision_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.precision.backward(loss, **kwargs)

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> AbstractContextManager[Any]:
        return self.precision.autocast()

    # -- the optimizer, clipping and the step

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        opt_model = self._prepared_model() if model is None else model
        if self.optimizer is None:
            optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames
            if optim not in _ADAMW:
                raise ValueError(
                    f"TrainingArguments(optim={optim!r}) is not the mixprec "
                    f"policy's optimizer: use optim='adamw_torch' (mixprec.optim.AdamW with the "
                    f"policy's master and moments), or pass optimizers=(your_optimizer, None)"
                )
            decay = set(self.get_decay_parameter_names(opt_model))
            trainable = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [  # the trainer's own grouping: no decay on biases and norms
                {
                    "params": [p for n, p in trainable if n in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            self.optimizer = self.precision.optimizer(
                [g for g in groups if g["params"]],
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        inner = self.optimizer
        if isinstance(inner, PrecisionOptimizer):
            inner = inner.optimizer
        held = {id(p) for group in inner.param_groups for p in group["params"]}
        missing = [
            n for n, p in opt_model.named_parameters() if p.requires_grad and id(p) not in held
        ]
        if missing:
            # A resume's PEFT load_adapter(is_trainable=True) makes new adapter parameters:
            # an optimizer built before it would train none of them.
            raise PrecisionError(
                f"{len(missing)} trainable parameters (first {missing[0]!r}) are not in the "
                f"trainer's optimizer: build it after the model is final, or let the trainer "
                f"build it (leave `optimizers` unset)"
            )
        self.optimizer = PrecisionOptimizer(inner, self.precision)
        return self.optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # Trainer clips through accelerate, which would clip loss-scaled gradients.
        return self.precision.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # max_grad_norm 0: measure the true norm, clip nothing
            grad_norm = self.precision.clip_grad_norm_(model.parameters(), math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[no-untyped-call]

    # -- logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs or "train_loss" in logs:
            logs = {**logs, **step_metrics(self.precision)}
        super().log(logs, start_time)

    # -- checkpoints

    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.args.should_save:
            torch.save(self.precision.state_dict(), os.path.join(output_dir, PRECISION_STATE_NAME))

    def _load_scaler(self, checkpoint: str | None) -> None:
        super()._load_scaler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRECISION_STATE_NAME)
        if not os.path.isfile(path):
            raise PrecisionError(
                f"checkpoint {checkpoint} has no {PRECISION_STATE_NAME} (the loss scale and "
                f"skip counts): resume from a checkpoint a PrecisionTrainer saved"
            )
        self.precision.load_state_dict(torch.load(path, weights_only=True))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        # PEFT's load_adapter(..., is_trainable=True) replaces the adapter parameters with
        # new fp32 ones: give them the policy's storage again (the optimizer is built after).
        self.precision.prepare(self._prepared_model())


class PrecisionTrainer(PrecisionTrainerMixin, Trainer):
    """`transformers.Trainer` under a mixprec policy (see `PrecisionTrainerMixin`)."""
