"""Loss scaling, and unscaling before anything reads the gradients.

The scaler is PyTorch's `torch.amp.GradScaler` (`ShardedGradScaler` for FSDP2
models), built from the plan's `LossScaling` settings; a run without loss
scaling gets a disabled one (a no-op with the same interface). What this module
adds around it:

* `ScaledGradients`: where the current step's gradients stand (which
  optimizers' gradients were unscaled, whether a scaled backward is pending,
  whether a gradient was edited in place while still scaled, as
  ``torch.nn.utils.clip_grad_norm_`` on scaled gradients does: said once, with
  `SCALED_EDIT_WARNING`), and the gradient-accumulation watch that catches a
  plain ``loss.backward()`` among ``prec.backward(loss)`` calls (unscaling would
  divide its unscaled part by the loss scale): one post-accumulate-grad hook per
  parameter of a registered optimizer, holding only a weak reference;
* `owning_optimizers`: which optimizers must unscale before a clip;
* `update_scale`: the scale bookkeeping of steps that do not go through
  `GradScaler.step` (closure steps, which it refuses, and skipped steps),
  matching what `GradScaler.update` would do.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mixprec.engine.gradients import optimizer_params
from mixprec.engine.plan import PrecisionPlan
from mixprec.errors import PrecisionError, PrecisionWarning, user_stacklevel
from mixprec.policy import LossScaling

__all__ = [
    "SCALED_EDIT_WARNING",
    "ScaledGradients",
    "make_scaler",
    "owning_optimizers",
    "update_scale",
]

#: Said once per `Precision` when gradients were edited in place between `backward`
#: and their unscale: torch's own clip then clips scaled gradients.
SCALED_EDIT_WARNING = (
    "gradients were changed in place after prec.backward while still multiplied by the "
    "loss scale ({scale:g}): torch.nn.utils.clip_grad_norm_ there clips the scaled "
    "gradients, so max_norm acts as max_norm / scale and updates shrink to almost nothing; "
    "use prec.clip_grad_norm_(params, max_norm) (it unscales first), or call "
    "prec.unscale_(optimizer) before your own clip (which also silences this for "
    "scale-free edits such as dividing every gradient by a constant)"
)


def make_scaler(
    settings: LossScaling | None, device_type: str, *, sharded: bool
) -> torch.amp.GradScaler:
    """The scaler for `settings` on `device_type` (disabled when `settings` is None);
    a `ShardedGradScaler` when the model is sharded (FSDP2)."""
    if settings is None:
        return torch.amp.GradScaler(device_type, enabled=False)
    kwargs: dict[str, Any] = {
        "init_scale": settings.init_scale,
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.growth_interval,
    }
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)


def update_scale(
    scaler: torch.amp.GradScaler, settings: LossScaling | None, *, found_inf: bool
) -> None:
    """End a step that did not go through `GradScaler.step` (a closure step, or one
    skipped for non-finite gradients), moving the scale as `GradScaler.update` would."""
    if settings is None:
        return
    if not settings.dynamic:
        scaler.update(new_scale=float(settings.init_scale))
        return
    if not found_inf:
        scaler.update()
        return
    # A rolled-back step: back off and restart the growth count, as GradScaler does
    # on overflow, through its public state_dict.
    state = scaler.state_dict()
    state["scale"] = float(state["scale"]) * settings.backoff_factor
    state["_growth_tracker"] = 0
    scaler.update(new_scale=float(state["scale"]))
    scaler.load_state_dict(state)


def owning_optimizers(
    params: Sequence[torch.Tensor], candidates: Iterable[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """The optimizers among `candidates` that hold a parameter of `params` with a
    gradient: those whose gradients a clip must unscale first.

    Raises:
        ValueError: some of those gradients belong to none of `candidates`.
    """
    wanted: set[int] = set()
    for p in params:
        if p.grad is not None:
            wanted.add(id(p))
    owning: list[torch.optim.Optimizer] = []
    covered: set[int] = set()
    for opt in candidates:
        held: set[int] = set()
        for group in opt.param_groups:
            for p in group["params"]:
                held.add(id(p))
        if not wanted.isdisjoint(held):
            owning.append(opt)
            covered |= held
    if not wanted <= covered:
        raise ValueError(
            "clip_grad_norm_ under loss scaling must unscale the gradients first, but "
            "some parameters belong to no optimizer this Precision knows; build the "
            "optimizer with prec.optimizer(...), call prec.register(optimizer), or pass "
            "optimizer=..."
        )
    return owning


def _grad_versions(optimizers: Iterable[torch.optim.Optimizer]) -> dict[int, tuple[int, int]]:
    """Each gradient's identity and in-place version counter, by parameter id."""
    versions: dict[int, tuple[int, int]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    versions[id(p)] = (id(p.grad), p.grad._version)
    return versions


class ScaledGradients:
    """Where the gradients of the current step stand (see the module docs).

    Args:
        plan: the run's plan: whether it scales the loss (without it nothing is
            watched or unscaled: `Precision` then backpropagates the loss itself), and
            its policy's name for the refusals.
    """

    def __init__(self, plan: PrecisionPlan) -> None:
        self.policy_name = plan.policy_name
        self.scales_loss = plan.scales_loss
        self.backward_pending = False
        #: Whether a watched gradient accumulated outside a scaled backward this step.
        self.unscaled_seen = False
        self._in_scaled_backward = False
        self._watched: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: tensors compare by value
        self._unscaled: set[int] = set()
        # The gradients' versions when backward returned: an in-place change before
        # their unscale (torch's clip on scaled gradients) is then seen.
        self._scaled_versions: dict[int, tuple[int, int]] = {}
        self._changed_while_scaled = False
        self._warned_scaled_edit = False
        self._found_inf: list[torch.Tensor] = []

    @property
    def unscaled_any(self) -> bool:
        """True once a gradient was unscaled this step (GradScaler's iteration began)."""
        return bool(self._unscaled)

    def found_inf(self) -> list[torch.Tensor]:
        """What `GradScaler.unscale_` found this step, per optimizer and device: a
        non-zero entry means a gradient was inf/NaN when it was unscaled, even if it
        was changed since (``clip_grad_value_`` clamps an inf to a finite value, and
        GradScaler then skips that optimizer's update)."""
        return self._found_inf

    @property
    def are_scaled(self) -> bool:
        """True between a scaled backward and the first unscale of the step."""
        return self.scales_loss and self.backward_pending and not self._unscaled

    @property
    def changed_while_scaled(self) -> bool:
        """True once an unscale found a gradient edited in place since backward."""
        return self._changed_while_scaled

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Under scaling, hook the gradient accumulation of `optimizer`'s parameters
        (each parameter once) to note any outside a scaled backward."""
        if not self.scales_loss:
            return
        ref = weakref.ref(self)

        def seen(_param: torch.Tensor) -> None:
            grads = ref()
            if grads is not None and not grads._in_scaled_backward:
                grads.unscaled_seen = True

        for p in optimizer_params(optimizer):
            known = self._watched.get(id(p))
            if p.requires_grad and (known is None or known() is not p):
                p.register_post_accumulate_grad_hook(seen)  # type: ignore[no-untyped-call]
                self._watched[id(p)] = weakref.ref(p)

    def backward(
        self,
        scaler: torch.amp.GradScaler,
        loss: torch.Tensor,
        optimizers: Iterable[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> None:
        """Backpropagate ``scaler.scale(loss)`` and note the gradients' versions."""
        scaled: torch.Tensor = scaler.scale(loss)
        self._in_scaled_backward = True
        try:
            torch.autograd.backward(scaled, **kwargs)
        finally:
            self._in_scaled_backward = False
        self.backward_pending = True
        if self.scales_loss:
            self._scaled_versions = _grad_versions(list(optimizers))

    def refuse_unscaled(self) -> None:
        """Raise `PrecisionError` when (part of) the gradients did not come through a
        scaled backward this step: unscaling would divide those parts by the loss scale
        (and on a first step GradScaler has no scale yet)."""
        if self.unscaled_seen:
            raise PrecisionError(
                f"policy {self.policy_name!r} scales the loss, but part of these gradients "
                "came from a backward that did not go through prec.backward(loss) (a "
                "loss.backward() among prec.backward calls?): those parts are unscaled and "
                "would be divided by the loss scale; call prec.backward(loss) for every loss"
            )
        if not self.backward_pending:
            raise PrecisionError(
                f"policy {self.policy_name!r} scales the loss, but these gradients did not "
                "come through prec.backward(loss) (was it loss.backward()?): they are "
                "unscaled, and unscaling them again would shrink them by the loss scale; "
                "call prec.backward(loss) instead"
            )

    def unscale(
        self, scaler: torch.amp.GradScaler, optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        """Unscale the gradients of each of `optimizers` once this step; the first time
        a gradient is found edited in place since backward, warn (`SCALED_EDIT_WARNING`)."""
        if not self.scales_loss:
            return
        optimizers = list(optimizers)
        if optimizers and (self.unscaled_seen or not self.backward_pending):
            self.refuse_unscaled()
        for opt in optimizers:
            if id(opt) not in self._unscaled:
                seen, changed = self._scaled_versions, False
                for key, version in _grad_versions([opt]).items():
                    changed = changed or seen.get(key, version) != version
                if changed:
                    self._changed_while_scaled = True
                    if not self._warned_scaled_edit:
                        self._warned_scaled_edit = True
                        warnings.warn(
                            SCALED_EDIT_WARNING.format(scale=float(scaler.get_scale())),
                            PrecisionWarning,
                            stacklevel=user_stacklevel(),
                        )
                scaler.unscale_(opt)
                self._unscaled.add(id(opt))
                # torch's own record of the unscale (the tensors GradScaler.step reads)
                self._found_inf.extend(scaler._found_inf_per_device(opt).values())

    def end_step(self) -> None:
        """Forget this step's state (the step applied or skipped, or raised)."""
        self._unscaled.clear()
        self._found_inf = []
        self.backward_pending = False
        self.unscaled_seen = False
        self._scaled_versions = {}
        self._changed_while_scaled = False
