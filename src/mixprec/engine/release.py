"""Gradient release: each parameter stepped as soon as its gradient is complete.

Under `Policy.release_gradients` `Precision` hooks every parameter of its optimizers
(``Tensor.register_post_accumulate_grad_hook``). Inside ``prec.backward(loss)`` the
hook of a parameter, run once its gradient is accumulated, checks that gradient
(under loss scaling it first unscales it as `GradScaler.unscale_` does, with
``torch._amp_foreach_non_finite_check_and_unscale_`` and the same inverse scale),
steps the parameter alone through its optimizer (`RuleOptimizer.step_param`: bitwise
its row of the batched step) and sets ``p.grad = None``. So no gradient of the whole
model is ever held: the memory of gradients is that of the few layers autograd is
between. `prec.step(optimizer)` then only finishes the step: the loss scale moves as
`GradScaler.update` moves it (``torch._amp_update_scale_``), a `StepReport` says what
was done, observers and the collapse checks run as for any step.

The non-finite promise: a non-finite gradient is never applied. Once a gradient
of a backward is inf/NaN (or the loss given to ``prec.backward`` is), no later
parameter of that backward is stepped: their gradients are dropped and the loss
scale backs off. Parameters stepped earlier in that backward keep their update (it
came from finite gradients; undoing it would need a copy of what it overwrote,
the memory this mode exists to save). `StepReport.released_params` and
`withheld_params` count both sides; ``applied`` is False. This differs from
`GradScaler`, which skips every parameter of such a step: the two agree when the
overflow is seen at the first parameter the backward completes (usually the one
nearest the loss, where overflows start), and otherwise release has applied the
finite part of the step.

Refused, with the reason: clipping by global norm (it needs every gradient before
any step), gradient accumulation (a second ``prec.backward`` before ``prec.step``,
or ``grad_accum_dtype``), a backward outside ``prec.backward``, closures,
optimizers other than mixprec's own (`Mastered`, torch's), and DDP or FSDP2 (their
reduction runs after the hook would have stepped on the local gradient).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from mixprec.engine.gradients import optimizer_params
from mixprec.engine.plan import PrecisionPlan
from mixprec.engine.stepping import StepContext, StepOutcome, count_nonfinite_weights
from mixprec.engine.wrappers import fsdp_modules, is_ddp
from mixprec.errors import PrecisionError
from mixprec.optim.rule_optimizer import RuleOptimizer
from mixprec.optim.sharding import is_dtensor
from mixprec.policy import Policy

__all__ = ["GradientRelease", "refuse_distributed", "refuse_trainer"]

#: A hooked parameter's entry: the parameter, its optimizer, whether its hook is on.
_Owner = tuple["weakref.ref[torch.Tensor]", "weakref.ref[RuleOptimizer]", bool]

_WHY = "release_gradients steps each parameter during backward"
_FIX = "use a policy without release_gradients (e.g. bf16_lean)"


def refuse_distributed(
    model: nn.Module | None, params: Sequence[torch.Tensor], policy: str
) -> None:
    """Raise `PrecisionError` under data parallelism: a DDP or FSDP2 model, DTensor
    parameters, or a process group of more than one rank (the reduction of a gradient
    runs after its hook, which would have stepped on the local gradient already)."""
    wrapped = model is not None and (is_ddp(model) or bool(fsdp_modules(model)))
    dist = torch.distributed
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if wrapped or ranks or any(map(is_dtensor, params)):
        raise PrecisionError(
            f"policy {policy!r}: {_WHY}, before DDP or FSDP2 reduce that gradient across "
            f"ranks (their reduction runs after the hook), so it is refused with them; {_FIX}"
        )


def refuse_trainer(policy: Policy, trainer: str) -> None:
    """Raise `PrecisionError` for a trainer integration (`trainer`) under a policy that
    releases gradients: the trainer runs its own backward, clipping and optimizer step,
    where release needs `prec.backward` to step each parameter."""
    if policy.release_gradients:
        raise PrecisionError(
            f"{trainer} with policy {policy.name!r}: {_WHY} inside prec.backward, and the "
            f"trainer runs its own backward, clipping and optimizer step; {_FIX}, or your "
            "own loop with prec.backward and prec.step (docs/release.md)"
        )


class GradientRelease:
    """The hooks and the state of one `Precision`'s released backward (see the module).

    Args:
        plan: the run's plan (its policy name, its loss scaling, its storage dtype).
    """

    def __init__(self, plan: PrecisionPlan) -> None:
        self.policy_name = plan.policy_name
        self.plan = plan
        # By id(p): the parameter and its optimizer, both weak (the hook holds neither),
        # and whether its hook is on (not on a parameter that did not require grad then).
        self._owners: dict[int, _Owner] = {}
        self._in_backward = False
        self._scaler: torch.amp.GradScaler | None = None
        self.end_step()

    def end_step(self) -> None:
        """Forget this step's backward (the step finished, or raised)."""
        self.backwards = 0  # prec.backward calls since the last step
        self.released = 0  # parameters stepped in this step's backward
        self.withheld = 0  # parameters not stepped: theirs or an earlier gradient non-finite
        self.halted = False  # a gradient (or the loss) of this backward was non-finite
        self.loss_finite = True
        self._norms: list[torch.Tensor] = []  # each checked gradient's 2-norm (the report)
        self._nonfinite: list[torch.Tensor] = []  # non-finite elements of withheld gradients
        self._stepped: list[torch.Tensor] = []  # parameters stepped, in order
        self._optimizers: set[int] = set()  # ids of the optimizers that stepped one
        self._found: dict[torch.device, torch.Tensor] = {}
        self._inv_scale: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook every parameter of `optimizer` (each once), refusing what release cannot
        step: an optimizer other than mixprec's own, distributed parameters."""
        if not isinstance(optimizer, RuleOptimizer):
            raise PrecisionError(
                f"policy {self.policy_name!r}: {_WHY}, alone, through mixprec's own "
                f"optimizers (mixprec.optim.AdamW, Adam, SGD, Lion); "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot do "
                f"that: use one of them, or {_FIX}"
            )
        params = optimizer_params(optimizer)
        refuse_distributed(None, params, self.policy_name)
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            release = ref()
            if release is not None:
                release._take(p)

        for p in params:
            known = self._owners.get(id(p))
            if known is not None and known[0]() is not p:
                known = None  # another tensor that had this id
            hooked = known is not None and known[2]
            if known is not None and known[1]() is optimizer and (hooked or not p.requires_grad):
                continue  # (the usual case: `finish` calls this every step)
            if p.requires_grad and not hooked:
                p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                hooked = True
            self._owners[id(p)] = (weakref.ref(p), weakref.ref(optimizer), hooked)

    @contextlib.contextmanager
    def backward(
        self, loss_finite: torch.Tensor, scaler: torch.amp.GradScaler | None
    ) -> Iterator[None]:
        """The one backward of a step (`Precision.backward`), its hooks stepping.

        Raises:
            PrecisionError: a second backward before the step (accumulation).
        """
        if self.backwards:
            raise PrecisionError(
                f"policy {self.policy_name!r}: a second prec.backward before prec.step: "
                f"{_WHY}, so gradients are never summed over micro-batches (accumulation "
                f"is refused); call prec.step after each backward, or {_FIX}"
            )
        self.backwards += 1
        self.loss_finite = bool(loss_finite)
        self.halted = not self.loss_finite  # a non-finite loss: nothing of it is stepped
        self._scaler = scaler
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False

    # ------------------------------------------------------------------ hook

    def _take(self, p: torch.Tensor) -> None:
        """`p`'s hook: its gradient is complete (see `_release`)."""
        if not self._in_backward:
            p.grad = None  # refused, so not kept for the next step to add to its own
            self._refuse_outside()
        owner = self._owners.get(id(p))
        optimizer = None if owner is None or owner[0]() is not p else owner[1]()
        if optimizer is not None:
            self._release(p, optimizer)

    def _refuse_outside(self) -> None:
        raise PrecisionError(
            f"policy {self.policy_name!r}: a gradient was completed outside "
            f"prec.backward (loss.backward()?); {_WHY} from prec.backward(loss), which "
            "checks it (and unscales it under loss scaling) first: call that instead"
        )

    def _release(self, p: torch.Tensor, optimizer: RuleOptimizer) -> None:
        """Step `p` with its gradient, or withhold it (see the module); free it."""
        grad = p.grad
        if grad is None:
            return
        if not self.halted:
            self.halted = not self._finite(grad)
        if self.halted:
            self.withheld += 1
            self._nonfinite.append((~torch.isfinite(grad)).sum())
        else:
            optimizer.step_param(p)
            self.released += 1
            self._stepped.append(p)
            self._optimizers.add(id(optimizer))
        p.grad = None

    def _finite(self, grad: torch.Tensor) -> bool:
        """Whether `grad` is finite (one host read), unscaled first under loss scaling;
        its norm is kept for the report (in its dtype, as torch's total norm takes it)."""
        device = grad.device
        scaler = self._scaler
        if device not in self._found:
            self._found[device] = torch.zeros((), dtype=torch.float32, device=device)
            inverse = torch.ones((), dtype=torch.float32, device=device)
            if scaler is not None and scaler.is_enabled():
                scale = scaler._scale
                assert scale is not None, "prec.backward scales the loss first"
                # As GradScaler.unscale_: the inverse in float64, rounded to float32 once.
                inverse = scale.double().reciprocal().float().to(device)
            self._inv_scale[device] = inverse
        found = self._found[device]
        scaled = scaler is not None and scaler.is_enabled()
        if scaled:  # GradScaler's own unscale and check
            torch._amp_foreach_non_finite_check_and_unscale_([grad], found, self._inv_scale[device])
        norm = torch._foreach_norm([grad])[0]
        self._norms.append(norm)
        if scaled:
            return not bool(found)
        if math.isfinite(float(norm)):
            return True
        # The norm can overflow on finite elements (fp16 past 65504): check the elements
        # themselves (multiplying by 1 changes no value).
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found, self._inv_scale[device])
        return not bool(found)

    # ------------------------------------------------------------------ step

    def finish(self, ctx: StepContext, optimizers: Sequence[torch.optim.Optimizer]) -> StepOutcome:
        """`Precision.step` under release: gradients that came without a hook are taken
        now (in parameter order: a parameter made trainable since `install`, which hooks
        it from now on, or one of an optimizer `prec.step` registered just now), then
        observers, the loss scale and the outcome."""
        for opt in optimizers:
            assert isinstance(opt, RuleOptimizer)  # (`install` refused the others)
            self.install(opt)
            for p in optimizer_params(opt):
                if p.grad is not None:
                    if not self.backwards:
                        self._refuse_outside()
                    self._release(p, opt)
        for observer in ctx.observers:
            observer.before_step(ctx.owner, optimizers, ctx.step)
        if self.released + self.withheld == 0:  # nothing to apply, nothing scaled
            return StepOutcome(True, (False,) * len(optimizers), 0.0, 0)
        norm = float(torch.linalg.vector_norm(torch.stack(self._norms))) if self._norms else 0.0
        nonfinite = int(sum(int(n) for n in self._nonfinite))
        if self.halted and math.isfinite(norm):
            norm = math.inf  # a withheld gradient was not measured: the norm is not finite
        ls = self.plan.loss_scaling
        scaler = ctx.scaler
        if ls is not None and not ls.dynamic:
            scaler.update(new_scale=float(ls.init_scale))
        elif ls is not None:
            # GradScaler.update's own operation, given what the hooks found.
            scale, tracker = scaler._scale, scaler._growth_tracker
            assert scale is not None and tracker is not None
            found = torch.full((), float(self.halted), dtype=torch.float32, device=scale.device)
            torch._amp_update_scale_(
                scale,
                tracker,
                found,
                scaler.get_growth_factor(),
                scaler.get_backoff_factor(),
                scaler.get_growth_interval(),
            )
        fp16 = self.plan.storage_dtype == torch.float16
        return StepOutcome(
            not self.halted,
            tuple(id(opt) in self._optimizers for opt in optimizers),
            norm,
            nonfinite,
            count_nonfinite_weights(self._stepped) if fp16 else 0,
            loss_finite=self.loss_finite if self.halted else None,
            released=self.released,
            withheld=self.withheld,
        )
