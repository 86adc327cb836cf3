"""`Precision`: run any PyTorch training loop under a precision policy.

The runtime composes PyTorch rather than rewriting it: forward passes run under
`torch.autocast`, loss scaling is `torch.amp.GradScaler` (`ShardedGradScaler` for
FSDP2 models). The policy is read once into a `PrecisionPlan` that every call
executes; what the runtime guarantees around those calls (true-gradient clipping,
no non-finite update ever applied, fp32 gradient accumulation, closures under loss
scaling, step reports, FP8 conversion) is listed in docs/runtime.md.

Example:
    >>> prec = Precision("bf16_master")
    >>> model = prec.prepare(model)
    >>> optimizer = prec.optimizer(model, lr=3e-4)
    >>> with prec.autocast():
    ...     loss = loss_fn(model(x), y)
    >>> prec.backward(loss)
    >>> prec.clip_grad_norm_(model.parameters(), 1.0)
    >>> report = prec.step(optimizer)
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.engine.accumulation import Fp32Accumulation, refuse_fsdp2
from mixprec.engine.effective import (
    check_compute,
    effective_precision,
    summary_text,
    warn_if_slow,
)
from mixprec.engine.fp8 import (
    Float8Conversion,
    convert_fp8_linears,
    refuse_float8_layers,
)
from mixprec.engine.gradients import optimizer_params
from mixprec.engine.observers import StepObserver
from mixprec.engine.optimizers import (
    ParamsArg,
    build_optimizer,
    check_optimizers,
    implied_param_groups,
    refuse_other_formats,
)
from mixprec.engine.plan import PrecisionPlan, resolve_plan
from mixprec.engine.release import GradientRelease, refuse_distributed
from mixprec.engine.scaling import ScaledGradients, make_scaler, owning_optimizers
from mixprec.engine.state import parse_state, precision_state
from mixprec.engine.stepping import (
    WEIGHT_OVERFLOW_WARNING,
    ClipNote,
    Closure,
    StepContext,
    check_collapse,
    check_limits,
    check_max_norm,
    record_step,
    step_plain,
    step_with_closure,
)
from mixprec.engine.storage import apply_storage, compiled_inner, forward_autocast
from mixprec.engine.wrappers import check_wrapped, fsdp_modules, is_ddp
from mixprec.errors import PrecisionError, PrecisionWarning, user_stacklevel
from mixprec.islands import island_names, island_param_ids
from mixprec.optim.sharding import is_dtensor
from mixprec.policy import Policy, preset, resolve_auto
from mixprec.telemetry import PrecisionStats, StepReport

if TYPE_CHECKING:
    from mixprec.speed import SpeedMeasurement

__all__ = ["Precision"]


class Precision:
    """Run a training loop under a precision `Policy`.

    The policy is resolved once, here, into `plan` (a `PrecisionPlan`); every
    method executes that plan.

    Args:
        policy: a `Policy`, or a preset name or alias (see `mixprec.preset`).
        device: the device type autocast runs on; by default taken from the model
            in `prepare` (or from `model`), else CUDA when available, else CPU.
        model: with ``"auto"`` only: a model whose training step is timed in fp32,
            bf16 and fp16 autocast on this device (`mixprec.speed.measure_speed`,
            cached per device and shapes); ``auto`` then picks the fastest safe
            preset from the measurement instead of from device facts. The model,
            its gradients and the RNG state are left as they were; call `prepare`
            as usual afterwards.
        example_input: the input `model` is timed on (required with `model`): a
            tuple is the positional arguments, a mapping the keyword arguments.
        max_consecutive_skips: raise `PrecisionError` after this many skipped steps
            in a row (None: never).
        min_loss_scale: raise `PrecisionError` when the dynamic loss scale falls
            below this (None: never).
        history_size: how many loss-scale changes `stats.scale_history` keeps.

    Attributes:
        policy: the `Policy` as given (kept for `state_dict` and messages).
        measured: the `SpeedMeasurement` a measured ``auto`` chose from, else None.
        plan: the `PrecisionPlan` every method executes, resolved once here.
        fp8: under an FP8 policy, what `prepare` did to the model last prepared (a
            `mixprec.engine.fp8.Float8Conversion`: recipe, emulation, the layers
            converted and those kept with why); None before `prepare` or without FP8.
        stats: the telemetry (`PrecisionStats`).
        observers: the `StepObserver`s called around every step.

    Raises:
        ValueError: a bad limit; `model` or `example_input` without the other, or
            with a policy other than ``"auto"``.
    """

    def __init__(
        self,
        policy_or_name: Policy | str = "fp32",
        *,
        device: torch.device | str | None = None,
        model: nn.Module | None = None,
        example_input: Any = None,
        max_consecutive_skips: int | None = 25,
        min_loss_scale: float | None = 1.0,
        history_size: int = 1000,
    ) -> None:
        self.measured: SpeedMeasurement | None = None
        if model is None and example_input is None:
            self.policy: Policy = preset(policy_or_name, device=device)
        else:
            from mixprec.speed.measure import measure_for_auto

            self.measured = measure_for_auto(policy_or_name, model, example_input, device)
            self.policy = resolve_auto(measured=self.measured)
        self.plan: PrecisionPlan = resolve_plan(self.policy)
        check_limits(max_consecutive_skips, min_loss_scale, history_size)
        self.max_consecutive_skips = max_consecutive_skips
        self.min_loss_scale = min_loss_scale
        self._device: torch.device | None = torch.device(device) if device is not None else None
        self.stats = PrecisionStats(history_size=history_size)
        self._scaler: torch.amp.GradScaler | None = None
        self._sharded = False
        # Each optimizer this run knows, with its number of param groups when `step` last
        # checked it against the plan (None: not checked since `register` or `prepare`).
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, int | None] = (
            weakref.WeakKeyDictionary()
        )
        self._compute_checked: torch.device | None = None  # where check_device passed
        self._grads = ScaledGradients(self.plan)
        self._accumulation = Fp32Accumulation()
        self._release = GradientRelease(self.plan)  # hooks only under release_gradients
        self._clip: ClipNote | None = None
        # Whether every loss given to `backward` this step was finite: a device tensor,
        # read only when a step is skipped (its report says where the overflow was seen).
        self._loss_finite: torch.Tensor | None = None
        self._warned_weight_overflow = False
        self._model: nn.Module | None = None  # the model last prepared
        self.fp8: Float8Conversion | None = None
        self.observers: list[StepObserver] = []

    # ------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        """The device autocast and the scaler run on."""
        if self._device is None:
            self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return self._device

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The `torch.amp.GradScaler` (disabled: a no-op) this run uses."""
        if self._scaler is None:
            self._scaler = make_scaler(
                self.plan.loss_scaling, self.device.type, sharded=self._sharded
            )
        return self._scaler

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or None without loss scaling."""
        if self.plan.loss_scaling is None:
            return None
        return float(self.scaler.get_scale())

    @property
    def fp32_islands(self) -> tuple[str, ...] | None:
        """Qualified names of the modules that run as fp32 islands now in the model last
        given to `prepare` (``""`` is the model itself); None before `prepare`."""
        return None if self._model is None else island_names(self._model)

    # --------------------------------------------------------------- prepare

    def check_device(self) -> None:
        """Raise `PrecisionError` if this device cannot compute in the plan's dtype
        (`prepare` calls it; `autocast` only on a device that has not passed it)."""
        check_compute(self.plan, self.device)
        self._compute_checked = self.device

    def prepare(self, model: nn.Module) -> nn.Module:
        """Set parameter storage to the plan's dtype, keeping fp32 islands.

        Parameters of modules matching `Policy.fp32_modules` (norm layers by
        default) stay fp32 and those modules run in fp32 with their inputs upcast.
        Islands apply only when parameters are stored in 16 bits; with fp32
        storage, autocast's own op lists decide. Buffers are left as they are.
        Returns the same model, changed in place; `fp32_islands` names the islands.
        A model already compiled (``torch.compile(model)``) is prepared through the
        module it runs, so names match as on the plain model, and comes back as given.

        Under an FP8 policy the eligible `nn.Linear` layers are then swapped for
        torchao's ``Float8Linear`` (`mixprec.engine.fp8`): parameters keep their
        identity, so optimizers are unaffected; `fp8` records the layers converted
        and kept, and a `PrecisionWarning` says when none qualifies. Only a model
        that is itself a converted `nn.Linear` comes back as a new module. Without
        torchao this raises `ImportError` with the install line.

        A model wrapped by FSDP2 or DDP must already hold the plan's storage dtypes
        (`mixprec.distributed.shard`/`ddp` set them before wrapping), and its wrappers
        must reduce gradients in the plan's ``reduce_dtype`` and cast outputs to its
        ``output_dtype``; otherwise `PrecisionError` names the fix. FP8 layers must be
        converted before wrapping: call `prepare` first.
        """
        given = model
        model = inner = compiled_inner(given)  # torch.compile(model): the module it runs
        first = next(iter(model.parameters()), None)
        if first is not None and self._device is None:
            self._device = first.device
        self.check_device()
        warn_if_slow(self.plan, self.device)
        for risk in self.plan.risks:
            warnings.warn(risk, PrecisionWarning, stacklevel=user_stacklevel())
        self._sharded = any(is_dtensor(p) for p in model.parameters())
        self._scaler = None  # rebuilt for this model's device and sharding
        islands = apply_storage(model, self.plan, self.device.type)
        check_wrapped(model, self.plan)
        if self.plan.release_gradients:
            refuse_distributed(model, list(model.parameters()), self.plan.policy_name)
        self._accumulate_in_fp32(model.parameters())
        for known in list(self._optimizers):  # their parameters may have been cast: recheck
            self._optimizers[known] = None
        self.fp8 = None
        if self.plan.fp8 is not None:
            model, self.fp8 = convert_fp8_linears(
                model,
                self.plan.fp8,
                device=self.device,
                islands=islands,
                policy=self.plan.policy_name,
                wrapped=is_ddp(model) or bool(fsdp_modules(model)),
            )
        else:
            refuse_float8_layers(model, self.plan.policy_name)
        self._model = model
        if given is inner:
            return model
        if model is not inner:
            raise PrecisionError(
                f"policy {self.plan.policy_name!r}: the compiled model is itself an "
                "nn.Linear that becomes a Float8Linear, a new module the compiled wrapper "
                "does not run; fix: prec.prepare(model) first, then torch.compile it"
            )
        return given

    def _accumulate_in_fp32(self, params: Iterable[torch.Tensor]) -> None:
        """Hook `params` for `Fp32Accumulation` when the plan asks for it (from `prepare`
        and `register`: an optimizer may hold parameters a later wrapper made)."""
        if self.plan.grad_accum_dtype is None:
            return
        params = list(params)
        refuse_fsdp2(params, self.plan.policy_name)
        self._accumulation.hook(params)

    # -------------------------------------------------------------- optimizer

    def optimizer(
        self,
        params: ParamsArg,
        lr: float | torch.Tensor | None = None,
        *,
        optimizer: type[torch.optim.Optimizer] | None = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer the plan implies, registered with this run: `mixprec.optim.AdamW`
        or the mixprec class ``optimizer=`` names (``Adam``, ``SGD``, ``Lion``), moments
        in the plan's format; for a torch optimizer class (``torch.optim.Muon``)
        `mixprec.optim.Mastered` over it (its state is its own, fp32). The param groups
        are the user's, exactly (a model means one group); 16-bit parameters get the
        plan's master, fp32 ones are their own master.
        ``lr`` (None: the optimizer's default) and other keyword arguments go to it.

        Raises:
            ValueError: ``master=``/``moments=`` other than the plan's (the policy
                decides them: change the policy, or build the optimizer yourself
                and `register` it).
        """
        refuse_other_formats(self.plan, kwargs, where="the call")
        for key in ("master", "moments"):  # the plan's own values, restated
            kwargs.pop(key, None)
        groups = implied_param_groups(self.plan, params, islands=island_param_ids(self._model))
        if lr is not None:
            kwargs["lr"] = lr
        return self.register(build_optimizer(self.plan, groups, optimizer, kwargs))

    def check_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Raise `PrecisionError` if an optimizer cannot honour the plan.

        `step` calls it once per optimizer, before its first update, again after
        `prepare` and when its number of param groups changes. Parameters must be
        stored as the plan says (16-bit ones in its storage dtype; fp32 ones are
        islands), and a 16-bit parameter under a plan with a master must be kept by a
        mixprec optimizer (or `Mastered`) with that master: an optimizer built before
        `prepare` (fp32 params then, no master), `torch.optim.AdamW` (no master,
        moments in the param's dtype) or a model cast after the optimizer was built
        would otherwise train 16-bit weights silently without one.
        """
        check_optimizers(self.plan, optimizers)

    def register(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Tell this run about an optimizer built elsewhere (needed before clipping
        under loss scaling, so clipping can unscale its gradients first); `step`
        registers those it has not seen, and checks each once (`check_optimizers`)."""
        if self.plan.release_gradients:
            self._release.install(optimizer)  # refuses what it cannot step
        self._optimizers[optimizer] = None
        self._grads.watch(optimizer)
        self._accumulate_in_fp32(optimizer_params(optimizer))
        return optimizer

    # --------------------------------------------------------------- forward

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which eligible ops compute in the plan's autocast dtype.

        A no-op context when the policy computes in its storage dtype. Raises
        `PrecisionError` if the device cannot run the dtype (never a silent swap).
        """
        compute = self.plan.autocast_dtype
        if compute is None:
            return contextlib.nullcontext()
        device = self.device
        if device != self._compute_checked:
            self.check_device()
        return forward_autocast(device.type, compute)

    # -------------------------------------------------------------- backward

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss`, scaled when the plan scales the loss. Under
        `Policy.release_gradients` each parameter is stepped here (docs/release.md)."""
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        scaler = self.scaler if self.plan.loss_scaling is not None else None
        releasing = self.plan.release_gradients  # each parameter stepped in its hook
        with self._release.backward(finite, scaler) if releasing else contextlib.nullcontext():
            if scaler is not None:
                self._grads.backward(scaler, loss, self._optimizers, **kwargs)
            else:
                torch.autograd.backward(loss, **kwargs)

    def _loss_was_finite(self) -> bool | None:
        """Whether every loss given to `backward` this step was finite (one host sync);
        None when no loss went through `backward`."""
        return None if self._loss_finite is None else bool(self._loss_finite)

    @property
    def gradients_are_scaled(self) -> bool:
        """True between `backward` and the unscale of a loss-scaled step: gradients
        then hold scale x their true value (clipping them now would be a bug)."""
        return self._grads.are_scaled

    @property
    def gradients_changed_while_scaled(self) -> bool:
        """True from the unscale of a loss-scaled step to the end of `step` when a
        gradient was changed in place between `backward` and that unscale (as
        ``torch.nn.utils.clip_grad_norm_`` on still-scaled gradients does); the
        doctor's ``clip-before-unscale`` reads it."""
        return self._grads.changed_while_scaled

    def add_observer(self, observer: StepObserver) -> StepObserver:
        """Call `observer` around every step (see `StepObserver`); returns it."""
        if not isinstance(observer, StepObserver):
            raise TypeError(f"{observer!r} has no before_step/after_step methods")
        self.observers.append(observer)
        return observer

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop calling `observer`."""
        self.observers.remove(observer)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of `optimizer` by the loss scale now (idempotent per step)."""
        self._refuse_under_release("prec.unscale_", "each gradient is unscaled in its hook")
        if optimizer not in self._optimizers:
            self.register(optimizer)
        self._grads.unscale(self.scaler, [optimizer])

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        *,
        norm_type: float = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """Clip gradients by their total norm, always on unscaled gradients.

        Under loss scaling the gradients are unscaled first (through the optimizer
        that owns them: the one passed, or those built by `optimizer`/`register`ed).

        Returns:
            The true total norm before clipping (inf/NaN if gradients are non-finite;
            such a step is then skipped by `step`).
        """
        if self.plan.release_gradients:  # (not a call on the ordinary path: step_trace)
            self._refuse_under_release("clip_grad_norm_", "the global norm needs every gradient")
        max_norm = check_max_norm(max_norm)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self.plan.loss_scaling is not None:
            owners = [optimizer] if optimizer is not None else list(self._optimizers)
            if optimizer is not None and optimizer not in self._optimizers:
                self.register(optimizer)
            self._grads.unscale(self.scaler, owning_optimizers(params, owners))
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=False
        )
        # Remembered for the step's report only: the step's non-finite decision is taken
        # over every gradient the optimizers hold, whatever this call saw.
        seen: set[int] = set()
        for p in params:
            if p.grad is not None:
                seen.add(id(p))
        self._clip = ClipNote(
            norm=norm.detach() if norm_type == 2.0 else None, param_ids=frozenset(seen)
        )
        return norm

    def _refuse_under_release(self, what: str, why: str) -> None:
        if self.plan.release_gradients:
            raise PrecisionError(
                f"policy {self.plan.policy_name!r} releases gradients: {what} is refused "
                f"({why}, and each parameter was stepped during backward); use a policy "
                "without release_gradients (e.g. bf16_lean)"
            )

    # ------------------------------------------------------------------ step

    def step(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        closure: Closure | None = None,
    ) -> StepReport:
        """Apply the optimizer update unless the gradients are non-finite.

        Under loss scaling this is `GradScaler.step` + `GradScaler.update` (the
        scale backs off on overflow and grows after `growth_interval` clean
        steps). Without it, non-finite gradients still skip the step. With a
        `closure` (LBFGS), the closure is evaluated here, each evaluation's
        gradients are unscaled and checked, and a step that meets non-finite
        gradients at any evaluation is rolled back.

        Raises:
            PrecisionError: an optimizer cannot honour the plan (`check_optimizers`);
                the loss scale fell below `min_loss_scale` or `max_consecutive_skips`
                steps in a row were skipped.
            ValueError: a closure with several optimizers.
        """
        optimizers = (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        if closure is not None and len(optimizers) != 1:
            raise ValueError("a closure step takes exactly one optimizer")
        if closure is not None:
            self._refuse_under_release("a closure", "its backward would step in its hooks")
        for opt in optimizers:
            groups = len(opt.param_groups)
            if self._optimizers.get(opt) != groups:  # new, re-prepared or grown: (re)check
                self.register(opt)
                self.check_optimizers([opt])
                self._optimizers[opt] = groups
        scaler = self.scaler
        scales = self.plan.loss_scaling is not None
        scale_before = float(scaler.get_scale()) if scales else None
        if scale_before is not None and not self.stats.scale_history:
            self.stats.record_scale(self.stats.steps, scale_before)
        ctx = StepContext(
            plan=self.plan,
            scaler=scaler,
            grads=self._grads,
            device=self.device,
            clip=self._clip,
            loss_was_finite=self._loss_was_finite,
            observers=self.observers,
            owner=self,
            step=self.stats.steps,
        )
        grad_mode = torch.is_grad_enabled()
        try:
            if self.plan.release_gradients:
                outcome = self._release.finish(ctx, optimizers)
            elif closure is None:
                outcome = step_plain(ctx, optimizers)
            else:
                outcome = step_with_closure(ctx, optimizers[0], closure)
        except BaseException:
            # An exception mid-step (a hook, an optimizer, a closure, a Ctrl-C) leaves the
            # step undefined (resuming from a checkpoint is the recovery), but the run goes
            # on: the scaler's iteration ends at its scale (else every later step raises
            # torch's "unscale_() has already been called ... since the last update()"), and
            # grad mode is restored (an interrupt in torch's no_grad() can leave it off).
            torch.set_grad_enabled(grad_mode)
            if scales and self._grads.unscaled_any:
                scaler.update(new_scale=float(scaler.get_scale()))
            raise
        finally:
            if scales:
                self._grads.end_step()
            if self.plan.grad_accum_dtype is not None:
                self._accumulation.release()
            self._clip = None
            self._loss_finite = None
            if self.plan.release_gradients:
                self._release.end_step()
        scale_after = float(scaler.get_scale()) if scales else None
        report = record_step(
            self.stats, outcome, scale_before=scale_before, scale_after=scale_after
        )
        if report.nonfinite_weights and not self._warned_weight_overflow:
            self._warned_weight_overflow = True
            warnings.warn(
                WEIGHT_OVERFLOW_WARNING.format(step=report.step, count=report.nonfinite_weights),
                PrecisionWarning,
                stacklevel=user_stacklevel(),
            )
        for observer in self.observers:
            observer.after_step(self, optimizers, report)
        if not report.applied or scale_after is not None:  # else nothing says it is stuck
            check_collapse(
                self.stats,
                min_loss_scale=self.min_loss_scale,
                max_consecutive_skips=self.max_consecutive_skips,
                loss_finite=report.loss_finite,
            )
        return report

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The scaler's and the telemetry's state (plain data and tensors)."""
        return precision_state(self.policy, self.scaler, self.stats)

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore `state_dict` output. With `strict`, the saved policy must match.

        Everything is validated before anything changes: a bad state leaves this
        `Precision` as it was.

        Raises:
            ValueError: a state that is not `state_dict` output (missing keys, a loss
                scale that is not a finite number > 0, malformed telemetry), or a
                different policy under `strict`.
        """
        scaler_state, stats = parse_state(state, policy=self.policy, strict=strict)
        if scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        self.stats = stats

    # -------------------------------------------------------------- describe

    def describe(self) -> dict[str, Any]:
        """Requested versus effective precision on this device, as plain data.

        Keys: ``policy`` (its fields), ``plan`` (`PrecisionPlan.to_dict`),
        ``fp32_islands`` (the island module names after `prepare`, else None),
        ``fp8`` (`Float8Conversion.to_dict` after `prepare` under an FP8 policy, else
        None), ``device``, ``device_name``, ``compute_supported``, ``compute_fast`` and
        ``reason`` (why the compute dtype is slow or unsupported here). `summary`
        says the same in a few lines of text.
        """
        return effective_precision(self.policy, self.plan, self.device, self.fp32_islands, self.fp8)

    def summary(self) -> str:
        """What this run will do, a few lines of text: the policy, the device, the
        plan (`PrecisionPlan.describe`), the fp32 island modules of the prepared
        model and, under an FP8 policy, its layers converted and kept."""
        return summary_text(self.policy, self.plan, self.describe(), self.fp8)

    def __repr__(self) -> str:
        fp8 = ""
        if self.fp8 is not None:
            how = "emulated" if self.fp8.emulate else "FP8 GEMMs"
            fp8 = f"; {len(self.fp8.converted)} fp8 layers ({how}), {len(self.fp8.kept)} kept"
        return f"Precision({self.policy.name!r}: {self.policy.describe()}{fp8})"
