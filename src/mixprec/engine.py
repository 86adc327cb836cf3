"""`Precision`: run any PyTorch training loop under a precision policy.

The runtime composes PyTorch rather than rewriting it: forward passes run under
`torch.autocast`, loss scaling is `torch.amp.GradScaler` (`ShardedGradScaler` for
FSDP2 models). What it adds is the discipline around them:

* gradients are always unscaled before they are clipped, and the clipped norm is
  the true one;
* a step with non-finite gradients is never applied, with or without a scaler;
* closure-based optimizers (LBFGS) work under loss scaling, which
  `GradScaler.step` refuses;
* every step returns a `StepReport`, and `Precision.stats` keeps the telemetry
  (skipped steps, the loss-scale history); a scale that keeps collapsing raises
  `PrecisionError` instead of looping forever.

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
import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from mixprec.device import device_caps
from mixprec.dtypes import dtype_name
from mixprec.errors import PerformanceWarning, PrecisionError, PrecisionWarning, user_stacklevel
from mixprec.islands import add_fp32_islands, is_fp32_island
from mixprec.optim.sharding import is_dtensor
from mixprec.policy import Policy, policy
from mixprec.telemetry import PrecisionStats, StepReport, check_scaler_state

__all__ = ["Precision", "PrecisionStats", "StepObserver", "StepReport"]

Closure = Callable[[], Any]
ParamsArg = nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]]


@runtime_checkable
class StepObserver(Protocol):
    """Something that watches steps (the doctor's runtime probes implement this).

    `before_step` runs once gradients are unscaled and checked, before the update;
    `after_step` runs after the update (or the skip), before collapse checks.
    """

    def before_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], step: int
    ) -> None:
        """Gradients are final (unscaled); parameters hold their pre-update values."""

    def after_step(
        self, prec: Precision, optimizers: Sequence[torch.optim.Optimizer], report: StepReport
    ) -> None:
        """The update was applied or skipped, as `report` says."""


class _NonFiniteInClosureError(Exception):
    """Raised inside a wrapped closure to abort an optimizer step with bad gradients."""


def _floating_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.grad is not None]


def _has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for p in _optimizer_params(optimizer))


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _check_max_norm(max_norm: float) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | torch.Tensor):
        raise TypeError(f"max_norm must be a number > 0 (e.g. 1.0), got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:  # also refuses NaN
        raise ValueError(
            f"max_norm must be > 0 (e.g. 1.0; float('inf') only measures the norm), got "
            f"{value!r}: 0 zeroes every gradient and a negative value trains by gradient ascent"
        )
    return value


def _count_nonfinite(grads: Sequence[torch.Tensor]) -> int:
    return int(sum(int((~torch.isfinite(g)).sum()) for g in grads))


def _total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)


def _any_across_ranks(flag: bool, device: torch.device) -> bool:
    """True if `flag` is true on any rank (every rank then skips together)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _grad_versions(optimizers: Iterable[torch.optim.Optimizer]) -> dict[int, tuple[int, int]]:
    """Each gradient's identity and in-place version counter, by parameter id."""
    return {
        id(p): (id(p.grad), p.grad._version)
        for opt in optimizers
        for p in _optimizer_params(opt)
        if p.grad is not None
    }


class Precision:
    """Run a training loop under a precision `Policy`.

    Args:
        policy: a `Policy`, or a preset name or alias (see `mixprec.policy`).
        device: the device type autocast runs on; by default taken from the model
            in `prepare`, else CUDA when available, else CPU.
        max_consecutive_skips: raise `PrecisionError` after this many skipped steps
            in a row (None: never).
        min_loss_scale: raise `PrecisionError` when the dynamic loss scale falls
            below this (None: never).
        history_size: how many loss-scale changes `stats.scale_history` keeps.
    """

    def __init__(
        self,
        policy_or_name: Policy | str = "fp32",
        *,
        device: torch.device | str | None = None,
        max_consecutive_skips: int | None = 25,
        min_loss_scale: float | None = 1.0,
        history_size: int = 1000,
    ) -> None:
        self.policy: Policy = policy(policy_or_name, device=device)
        _refuse_unapplied_fields(self.policy)
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips must be >= 1 or None, got {max_consecutive_skips}"
            )
        if history_size < 1:
            raise ValueError(f"history_size must be >= 1, got {history_size}")
        self.max_consecutive_skips = max_consecutive_skips
        self.min_loss_scale = min_loss_scale
        self._device: torch.device | None = torch.device(device) if device is not None else None
        self.stats = PrecisionStats(history_size=history_size)
        self._scaler: torch.amp.GradScaler | None = None
        self._sharded = False
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._unscaled: set[int] = set()
        self._pending_norm: torch.Tensor | None = None
        self._pending_ids: frozenset[int] = frozenset()
        self._backward_pending = False
        # Under loss scaling, gradient hooks note any accumulation outside prec.backward.
        self._in_scaled_backward = False
        self._unscaled_backward = False
        # Under loss scaling, the gradients' versions when backward returned: an in-place
        # change before their unscale (torch's clip on scaled gradients) is then seen.
        self._scaled_versions: dict[int, tuple[int, int]] = {}
        self._changed_while_scaled = False
        self._watched: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: tensors compare by value
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
            self._scaler = self._make_scaler()
        return self._scaler

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or None without loss scaling."""
        if not self.policy.scales_loss:
            return None
        return float(self.scaler.get_scale())

    def _make_scaler(self) -> torch.amp.GradScaler:
        ls = self.policy.loss_scaling
        kind = self.device.type
        if ls is None:
            return torch.amp.GradScaler(kind, enabled=False)
        kwargs: dict[str, Any] = {
            "init_scale": ls.init_scale,
            "growth_factor": ls.growth_factor,
            "backoff_factor": ls.backoff_factor,
            "growth_interval": ls.growth_interval,
        }
        if self._sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(kind, **kwargs)
        return torch.amp.GradScaler(kind, **kwargs)

    # --------------------------------------------------------------- prepare

    def check_device(self) -> None:
        """Raise `PrecisionError` if this device cannot compute in the policy's dtype."""
        compute = self.policy.compute_dtype
        if compute is None:
            return
        caps = device_caps(self.device)
        if not caps.supported(compute):
            raise PrecisionError(
                f"policy {self.policy.name!r} asks for {dtype_name(compute)} compute, which "
                f"{caps.name} cannot run: {caps.reason(compute)}; mixprec does not swap formats "
                "silently: choose another policy (e.g. 'auto')"
            )

    def prepare(self, model: nn.Module) -> nn.Module:
        """Set parameter storage to the policy's dtype, keeping fp32 islands.

        Parameters of modules matching `Policy.fp32_modules` (norm layers by
        default) stay fp32 and those modules run in fp32 with their inputs upcast.
        Islands apply only when parameters are stored in 16 bits; with fp32
        storage, autocast's own op lists decide. Buffers are left as they are.
        Returns the same model, changed in place.
        """
        first = next(iter(model.parameters()), None)
        if first is not None and self._device is None:
            self._device = first.device
        self.check_device()
        compute = self.policy.compute_dtype
        if compute is not None:
            caps = device_caps(self.device)
            if not caps.fast(compute):
                warnings.warn(
                    f"{dtype_name(compute)} compute is not accelerated on {caps.name}: "
                    f"{caps.reason(compute)}; the run is correct but may be slower than fp32",
                    PerformanceWarning,
                    stacklevel=user_stacklevel(),
                )
        for risk in self.policy.risks():
            warnings.warn(risk, PrecisionWarning, stacklevel=user_stacklevel())
        self._sharded = any(is_dtensor(p) for p in model.parameters())
        self._scaler = None  # rebuilt for this model's device and sharding
        storage = self.policy.param_dtype
        add_fp32_islands(model, self.policy, self.device.type)
        island_params = {
            id(p) for m in model.modules() if is_fp32_island(m) for p in m.parameters()
        }
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_floating_point():
                    continue
                target = torch.float32 if id(p) in island_params else storage
                if p.dtype != target:
                    p.data = p.data.to(target)
        return model

    # -------------------------------------------------------------- optimizer

    def optimizer(
        self,
        params: ParamsArg,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """The AdamW the policy implies (`mixprec.optim.AdamW`), registered with this run.

        16-bit parameters get the policy's master representation; fp32 parameters
        (fp32 islands, or everything under an fp32-storage policy) need none.
        Moments use the policy's moment format. Extra keyword arguments go to the
        optimizer.
        """
        from mixprec.optim import AdamW

        groups: list[dict[str, Any]] = []
        raw = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
        if raw and isinstance(raw[0], dict):
            source = cast(list[dict[str, Any]], raw)
        else:
            source = [{"params": raw}]
        for group in source:
            tensors = list(group["params"])
            rest = {k: v for k, v in group.items() if k != "params"}
            half = [p for p in tensors if p.dtype != torch.float32]
            full = [p for p in tensors if p.dtype == torch.float32]
            if half:
                groups.append({"params": half, **rest, "master": self.policy.master})
            if full:
                groups.append({"params": full, **rest, "master": "none"})
        opt = AdamW(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            moments=self.policy.moments,
            **kwargs,
        )
        self.register(opt)
        return opt

    def check_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Raise `PrecisionError` if an optimizer cannot honour the policy.

        Called by `step` before every update. Parameters must be stored as the policy
        says (16-bit ones in `Policy.param_dtype`; fp32 ones are islands), and a 16-bit
        parameter under a policy with a master must be kept by a `mixprec.optim.AdamW`
        group with that master: an optimizer built before `prepare` (fp32 params then,
        no master), `torch.optim.AdamW` (no master, moments in the param's dtype) or a
        model cast after the optimizer was built would otherwise train 16-bit weights
        silently without one.
        """
        pol = self.policy
        for opt in optimizers:
            format_of = getattr(opt, "format_of", None)
            for p in _optimizer_params(opt):
                if p.dtype not in _SIXTEEN_BIT:
                    continue
                if p.dtype != pol.param_dtype:
                    raise PrecisionError(
                        f"policy {pol.name!r} stores parameters in {dtype_name(pol.param_dtype)}, "
                        f"but {type(opt).__name__} holds a {dtype_name(p.dtype)} parameter of "
                        f"shape {tuple(p.shape)} (was the model cast after prec.prepare?); "
                        "let prec.prepare(model) set storage dtypes, then build the optimizer "
                        "with prec.optimizer(model)"
                    )
                if pol.master == "none":
                    continue
                if format_of is None:
                    raise PrecisionError(
                        f"policy {pol.name!r} keeps a {pol.master!r} master for "
                        f"{dtype_name(p.dtype)} parameters, which {type(opt).__name__} cannot "
                        "do (it updates 16-bit weights directly and keeps its state in their "
                        "dtype); build the optimizer with prec.optimizer(model) or "
                        f"mixprec.optim.AdamW(..., master={pol.master!r})"
                    )
                master, _moments = format_of(p)
                if master == "none":
                    raise PrecisionError(
                        f"policy {pol.name!r} keeps a {pol.master!r} master for "
                        f"{dtype_name(p.dtype)} parameters, but the optimizer keeps parameter "
                        f"{tuple(p.shape)} with no master (it was built before prec.prepare "
                        "cast the model, or with master='none'); call prec.prepare(model) "
                        "first, then prec.optimizer(model)"
                    )

    def register(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Tell this run about an optimizer built elsewhere (needed before clipping
        under loss scaling, so clipping can unscale its gradients first)."""
        self._optimizers.add(optimizer)
        if self.policy.scales_loss:
            self._watch_accumulation(optimizer)
        return optimizer

    def _watch_accumulation(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook each parameter's gradient accumulation: a backward outside `backward`
        (an unscaled ``loss.backward()`` among scaled ones) is then refused at `step`."""
        ref = weakref.ref(self)

        def seen(_param: torch.Tensor) -> None:
            prec = ref()
            if prec is not None and not prec._in_scaled_backward:
                prec._unscaled_backward = True

        for p in _optimizer_params(optimizer):
            known = self._watched.get(id(p))
            if p.requires_grad and (known is None or known() is not p):
                p.register_post_accumulate_grad_hook(seen)  # type: ignore[no-untyped-call]
                self._watched[id(p)] = weakref.ref(p)

    # --------------------------------------------------------------- forward

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which eligible ops compute in the policy's compute dtype.

        A no-op context when the policy computes in its storage dtype. Raises
        `PrecisionError` if the device cannot run the dtype (never a silent swap).
        """
        compute = self.policy.compute_dtype
        if compute is None:
            return contextlib.nullcontext()
        self.check_device()
        return torch.autocast(device_type=self.device.type, dtype=compute)

    # -------------------------------------------------------------- backward

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss`, scaled when the policy scales the loss."""
        scaled: torch.Tensor = self.scaler.scale(loss)
        self._in_scaled_backward = True
        try:
            torch.autograd.backward(scaled, **kwargs)
        finally:
            self._in_scaled_backward = False
        self._backward_pending = True
        if self.policy.scales_loss:
            self._scaled_versions = _grad_versions(list(self._optimizers))

    @property
    def gradients_are_scaled(self) -> bool:
        """True between `backward` and the unscale of a loss-scaled step: gradients
        then hold scale x their true value (clipping them now would be a bug)."""
        return self.policy.scales_loss and self._backward_pending and not self._unscaled

    @property
    def gradients_changed_while_scaled(self) -> bool:
        """True from the unscale of a loss-scaled step to the end of `step` when a
        gradient was changed in place between `backward` and that unscale (as
        ``torch.nn.utils.clip_grad_norm_`` on still-scaled gradients does); the
        doctor's ``clip-before-unscale`` reads it."""
        return self._changed_while_scaled

    def add_observer(self, observer: StepObserver) -> StepObserver:
        """Call `observer` around every step (see `StepObserver`); returns it."""
        if not isinstance(observer, StepObserver):
            raise TypeError(f"{observer!r} has no before_step/after_step methods")
        self.observers.append(observer)
        return observer

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop calling `observer`."""
        self.observers.remove(observer)

    def _unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        if not self.policy.scales_loss:
            return
        for opt in optimizers:
            if id(opt) not in self._unscaled:
                seen = self._scaled_versions
                now = _grad_versions([opt])
                if any(seen.get(key, version) != version for key, version in now.items()):
                    self._changed_while_scaled = True
                self.scaler.unscale_(opt)
                self._unscaled.add(id(opt))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of `optimizer` by the loss scale now (idempotent per step)."""
        self.register(optimizer)
        self._unscale([optimizer])

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
        max_norm = _check_max_norm(max_norm)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self.policy.scales_loss:
            owners = [optimizer] if optimizer is not None else list(self._optimizers)
            if optimizer is not None:
                self.register(optimizer)
            wanted = {id(p) for p in params if p.grad is not None}
            owning = [o for o in owners if wanted & {id(p) for p in _optimizer_params(o)}]
            covered = {id(p) for o in owning for p in _optimizer_params(o)}
            if not wanted <= covered:
                raise ValueError(
                    "clip_grad_norm_ under loss scaling must unscale the gradients first, but "
                    "some parameters belong to no optimizer this Precision knows; build the "
                    "optimizer with prec.optimizer(...), call prec.register(optimizer), or pass "
                    "optimizer=..."
                )
            self._unscale(owning)
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=False
        )
        # Remembered for the step's report only: the step's non-finite decision is taken
        # over every gradient the optimizers hold, whatever this call saw.
        self._pending_norm = norm.detach() if norm_type == 2.0 else None
        self._pending_ids = frozenset(id(p) for p in params if p.grad is not None)
        return norm

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
            PrecisionError: when the loss scale falls below `min_loss_scale` or
                `max_consecutive_skips` steps in a row were skipped.
        """
        optimizers = (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        for opt in optimizers:
            self.register(opt)
        self.check_optimizers(optimizers)
        scale_before = self.loss_scale
        if scale_before is not None and not self.stats.scale_history:
            self.stats.record_scale(self.stats.steps, scale_before)
        with_grads = tuple(_has_grads(opt) for opt in optimizers)
        try:
            if closure is not None:
                applied, norm, nonfinite = self._step_with_closure(optimizers, closure)
            else:
                applied, norm, nonfinite = self._step_plain(optimizers)
        finally:
            self._unscaled.clear()
            self._pending_norm = None
            self._pending_ids = frozenset()
            self._backward_pending = False
            self._unscaled_backward = False
            self._scaled_versions = {}
            self._changed_while_scaled = False
        stepped = tuple(applied and g for g in with_grads)
        report = self._finish(applied, norm, nonfinite, scale_before, stepped)
        for observer in self.observers:
            observer.after_step(self, optimizers, report)
        self._check_collapse()
        return report

    def _notify_before(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for observer in self.observers:
            observer.before_step(self, optimizers, self.stats.steps)

    def _check_grads(self, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[float, int]:
        """The reported gradient norm and the count of non-finite gradient elements.

        The decision covers every gradient of every optimizer: one fused norm over all
        of them, read with one host sync (together with a clip's pre-clip norm, which
        is reported when that clip saw every gradient).
        """
        params = [p for opt in optimizers for p in _optimizer_params(opt) if p.grad is not None]
        grads = [cast(torch.Tensor, p.grad) for p in params]
        if not grads:
            return 0.0, 0
        total = _total_norm(grads).float()
        pending = self._pending_norm
        clip_saw_all = pending is not None and {id(p) for p in params} <= self._pending_ids
        if clip_saw_all and pending is not None:
            values = torch.stack([total, pending.float().to(total.device)]).tolist()
            now, norm = values[0], values[1]
        else:
            now = norm = float(total)
        if math.isfinite(now) and math.isfinite(norm):
            return norm, 0
        # The norm can overflow fp32 on finite gradients (an element of 2e19): decide on
        # the elements themselves, not on the norm.
        return (norm if not math.isfinite(norm) else now), _count_nonfinite(grads)

    def _step_plain(self, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[bool, float, int]:
        if not any(_has_grads(opt) for opt in optimizers):
            self._notify_before(optimizers)
            return True, 0.0, 0  # nothing to apply (and nothing a scaler has seen)
        if self.policy.scales_loss and self._unscaled_backward:
            raise PrecisionError(
                f"policy {self.policy.name!r} scales the loss, but part of these gradients came "
                "from a backward that did not go through prec.backward(loss) (a "
                "loss.backward() among prec.backward calls?): those parts are unscaled and "
                "would be divided by the loss scale; call prec.backward(loss) for every loss"
            )
        if self.policy.scales_loss and not self._backward_pending:
            raise PrecisionError(
                f"policy {self.policy.name!r} scales the loss, but these gradients did not come "
                "through prec.backward(loss) (was it loss.backward()?): they are unscaled, and "
                "unscaling them again would shrink them by the loss scale; call "
                "prec.backward(loss) instead"
            )
        self._unscale(optimizers)
        norm, nonfinite = self._check_grads(optimizers)
        self._notify_before(optimizers)
        # One decision for every optimizer of the step, taken on every rank together.
        bad = _any_across_ranks(nonfinite > 0, self.device)
        ls = self.policy.loss_scaling
        if ls is not None and ls.dynamic:
            if bad:
                self._update_scale(found_inf=True)  # back off, as GradScaler does
                return False, norm, nonfinite
            stepping = [opt for opt in optimizers if _has_grads(opt)]
            for opt in stepping:
                self.scaler.step(opt)
            if stepping:
                self.scaler.update()
            else:  # nothing was unscaled: end the iteration without moving the scale
                self.scaler.update(new_scale=float(self.scaler.get_scale()))
            return True, norm, nonfinite
        if not bad:
            for opt in optimizers:
                opt.step()
        if ls is not None:
            # Static scale: end GradScaler's iteration without moving the scale.
            self.scaler.update(new_scale=float(ls.init_scale))
        return not bad, norm, nonfinite

    def _step_with_closure(
        self, optimizers: Sequence[torch.optim.Optimizer], closure: Closure
    ) -> tuple[bool, float, int]:
        if len(optimizers) != 1:
            raise ValueError("a closure step takes exactly one optimizer")
        opt = optimizers[0]
        with torch.enable_grad():
            first_loss = closure()
        self._unscale([opt])
        norm, nonfinite = self._check_grads([opt])
        self._notify_before([opt])
        if _any_across_ranks(nonfinite > 0, self.device):
            self._update_scale(found_inf=True)
            return False, norm, nonfinite
        params = _optimizer_params(opt)
        saved_params = [p.detach().clone() for p in params]
        saved_state = copy.deepcopy(opt.state_dict())
        inv_scale = 1.0 / (self.loss_scale or 1.0)
        calls = 0

        def wrapped() -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # gradients of the first evaluation are already unscaled
                return first_loss
            with torch.enable_grad():
                loss = closure()
            grads = [p.grad for p in params if p.grad is not None]
            if inv_scale != 1.0:
                torch._foreach_mul_(grads, inv_scale)
            if not math.isfinite(float(_total_norm(grads))):
                raise _NonFiniteInClosureError
            return loss

        try:
            if self.policy.scales_loss:
                self.scaler.step(opt, wrapped)  # positional: GradScaler only refuses kwargs
            else:
                opt.step(wrapped)
        except _NonFiniteInClosureError:
            with torch.no_grad():
                for p, saved in zip(params, saved_params, strict=True):
                    p.copy_(saved)
            opt.load_state_dict(saved_state)
            self._update_scale(found_inf=True)
            return False, norm, max(nonfinite, 1)
        self._update_scale(found_inf=False)
        return True, norm, nonfinite

    def _update_scale(self, *, found_inf: bool) -> None:
        """Scale bookkeeping for closure steps, matching `GradScaler.update`."""
        ls = self.policy.loss_scaling
        if ls is None:
            return
        if not ls.dynamic:
            self.scaler.update(new_scale=float(ls.init_scale))
            return
        if not found_inf:
            self.scaler.update()
            return
        # A rolled-back step: back off and restart the growth count, as GradScaler does
        # on overflow, through its public state_dict.
        state = self.scaler.state_dict()
        state["scale"] = float(state["scale"]) * ls.backoff_factor
        state["_growth_tracker"] = 0
        self.scaler.update(new_scale=float(state["scale"]))
        self.scaler.load_state_dict(state)

    def _finish(
        self,
        applied: bool,
        norm: float,
        nonfinite: int,
        scale_before: float | None,
        stepped: tuple[bool, ...] = (),
    ) -> StepReport:
        stats = self.stats
        index = stats.steps
        stats.steps += 1
        if applied:
            stats.applied_steps += 1
            stats.consecutive_skips = 0
        else:
            stats.skipped_steps += 1
            stats.consecutive_skips += 1
        if nonfinite:
            stats.last_nonfinite_step = index
        scale_after = self.loss_scale
        if scale_after is not None:
            stats.record_scale(stats.steps, scale_after)
        report = StepReport(
            step=index,
            applied=applied,
            scale=scale_before,
            next_scale=scale_after,
            grad_norm=norm,
            nonfinite_grads=nonfinite,
            stepped=stepped,
        )
        return report

    def _check_collapse(self) -> None:
        stats = self.stats
        history = ", ".join(f"step {s}: {v:g}" for s, v in list(stats.scale_history)[-12:])
        scale = stats.loss_scale
        if scale is not None and self.min_loss_scale is not None and scale < self.min_loss_scale:
            raise PrecisionError(
                f"the loss scale collapsed to {scale:g} (below {self.min_loss_scale:g}) after "
                f"{stats.consecutive_skips} consecutive skipped steps; gradients are non-finite "
                f"even unscaled, so the forward pass or the loss is producing inf/NaN. "
                f"Recent loss scales: {history}. Find the source with mixprec's doctor "
                "(nonfinite-source), lower the learning rate, or compute in bf16"
            )
        limit = self.max_consecutive_skips
        if limit is not None and stats.consecutive_skips >= limit:
            raise PrecisionError(
                f"{stats.consecutive_skips} consecutive steps had non-finite gradients and were "
                f"skipped (limit max_consecutive_skips={limit}); training is not progressing. "
                + (f"Recent loss scales: {history}. " if history else "")
                + "Find the source with mixprec's doctor (nonfinite-source) or lower the "
                "learning rate"
            )

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The scaler's and the telemetry's state (plain data and tensors)."""
        return {
            "policy": self.policy.to_dict(),
            "scaler": self.scaler.state_dict(),
            "stats": self.stats.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore `state_dict` output. With `strict`, the saved policy must match.

        Everything is validated before anything changes: a bad state leaves this
        `Precision` as it was.

        Raises:
            ValueError: a state that is not `state_dict` output (missing keys, a loss
                scale that is not a finite number > 0, malformed telemetry), or a
                different policy under `strict`.
        """
        if not isinstance(state, dict):
            raise ValueError(
                f"Precision state must be a dict from Precision.state_dict(), got "
                f"{type(state).__name__}"
            )
        missing = [k for k in ("policy", "scaler", "stats") if k not in state]
        if missing:
            raise ValueError(
                f"Precision state is missing {missing}; expected Precision.state_dict() output"
            )
        saved = state["policy"]
        if not isinstance(saved, dict):
            raise ValueError(f"Precision state 'policy' must be a dict, got {saved!r}")
        if strict:
            mine = self.policy.to_dict()
            diff = sorted(k for k in mine if k not in ("name", "note") and saved.get(k) != mine[k])
            if diff:
                raise ValueError(
                    f"state was saved under a different policy (fields {diff} differ: saved "
                    f"{ {k: saved.get(k) for k in diff} }, now { {k: mine[k] for k in diff} }); "
                    "pass strict=False to resume under the new policy deliberately"
                )
        scaler_state = state["scaler"]
        if not isinstance(scaler_state, dict):
            raise ValueError(f"Precision state 'scaler' must be a dict, got {scaler_state!r}")
        if scaler_state and self.policy.scales_loss:
            check_scaler_state(scaler_state)
        raw_stats = state["stats"]
        if not isinstance(raw_stats, dict):
            raise ValueError(f"Precision state 'stats' must be a dict, got {raw_stats!r}")
        stats = PrecisionStats.from_dict(raw_stats)
        if scaler_state and self.policy.scales_loss:
            self.scaler.load_state_dict(scaler_state)
        self.stats = stats

    def describe(self) -> dict[str, Any]:
        """Requested versus effective precision on this device, as plain data."""
        compute = self.policy.compute_dtype
        caps = device_caps(self.device)
        return {
            "policy": self.policy.to_dict(),
            "device": str(self.device),
            "device_name": caps.name,
            "compute_supported": True if compute is None else caps.supported(compute),
            "compute_fast": True if compute is None else caps.fast(compute),
            "reason": "" if compute is None else caps.reason(compute),
        }

    def __repr__(self) -> str:
        return f"Precision({self.policy.name!r}: {self.policy.describe()})"


def _refuse_unapplied_fields(pol: Policy) -> None:
    # Every policy field is honoured or refused: gradient reduction and FSDP2 output
    # casting belong to the distributed wrappers, which this release does not have, so
    # a non-default value would be silently ignored.
    if pol.reduce_dtype != torch.float32:
        raise ValueError(
            f"policy {pol.name!r} asks for reduce_dtype={dtype_name(pol.reduce_dtype)}, but "
            "nothing in this setup reduces gradients in a chosen dtype (Precision runs one "
            "process; DDP/FSDP2 wrappers that apply it are not available yet), so it would be "
            "ignored; fix: reduce_dtype=torch.float32 (the default)"
        )
    if pol.output_dtype is not None:
        raise ValueError(
            f"policy {pol.name!r} asks for output_dtype={dtype_name(pol.output_dtype)}, which "
            "only an FSDP2 MixedPrecisionPolicy applies and this setup has none, so it would be "
            "ignored; fix: output_dtype=None (the default)"
        )
