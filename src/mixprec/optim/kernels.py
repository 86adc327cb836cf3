"""The fused step: decode master and moments, update in fp32, encode, write in place.

`step_` composes the pure pieces (formats and the update rule, `mixprec.optim.rules`)
for one flattened parameter; a batch of
parameters (`mixprec.optim.step_batch.StepKernel`) runs one of three ways, all
bitwise identical:

* native (CPU): the C++ kernel of `mixprec.optim.native`, one pass over memory;
* compiled: `torch.compile` (Inductor; dim 0 marked dynamic, so one graph per
  format family serves every tensor size, see `mixprec.optim.inductor`): the
  fused path on CUDA, and on CPU for what the native kernel does not cover
  (fp16) or when it cannot be built;
* eager: the PyTorch ops themselves (the reference).

`resolve_mode` is the rule that maps ``fused`` to one of them.
"""

from __future__ import annotations

import functools
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mixprec.formats import MasterFormat, MomentFormat, StateTensor
from mixprec.optim import native
from mixprec.optim.inductor import compile_fn
from mixprec.optim.rng import uniform16
from mixprec.optim.rules import Rule

__all__ = [
    "AUTO_COMPILE_MIN_NUMEL",
    "KERNEL_MODES",
    "StepFamily",
    "StepFn",
    "compiled_family_function",
    "family_function",
    "resolve_mode",
    "step_",
    "warn_native_unavailable",
]

KernelMode = Literal["auto", "compiled", "eager", "native", "native-auto", "native-eager"]
#: Every `KernelMode`.
KERNEL_MODES: tuple[str, ...] = typing.get_args(KernelMode)

#: ``fused=None`` fuses the step of a CPU param group holding at least this
#: many elements (2**20: above every built-in workload). Below it the eager
#: step costs little in absolute terms, and small models and tests need no
#: compiler (the native kernel's one-time build takes about 5 s, an Inductor
#: compile of a family 10-30 s).
AUTO_COMPILE_MIN_NUMEL = 1 << 20


def resolve_mode(fused: bool | None, *, device_type: str, numel: int) -> KernelMode:
    """How one param group steps.

    * ``fused=False``: ``"eager"``.
    * ``fused=True``: on CPU ``"native"`` (the native kernel; what it cannot
      run goes to ``"compiled"``), elsewhere ``"compiled"`` (`torch.compile`;
      a failure raises).
    * ``fused=None``: on CUDA ``"auto"`` (compile; on failure warn once and
      run eagerly); on CPU the native kernel for every group (it costs no
      compile): ``"native-auto"`` for groups of at least `AUTO_COMPILE_MIN_NUMEL`
      elements (native, else ``"auto"``), ``"native-eager"`` for smaller ones
      (native, else eager: compiling small groups does not pay).

    With ``MIXPREC_NATIVE=0`` CPU groups take the ``torch.compile`` modes instead.
    """
    if fused is False:
        return "eager"
    large = numel >= AUTO_COMPILE_MIN_NUMEL
    if device_type == "cpu" and native.enabled():
        if fused:
            return "native"
        return "native-auto" if large else "native-eager"
    if fused:
        return "compiled"
    return "auto" if device_type == "cuda" or large else "eager"


@dataclass(frozen=True)
class StepFamily:
    """Everything static about a step: the rule, formats and flags (one compiled graph each)."""

    rule: Rule
    master: MasterFormat
    moments: MomentFormat
    maximize: bool

    @property
    def name(self) -> str:
        """A readable identifier, e.g. ``adamw_exact_fp32`` or ``sgd_momentum_exact_int8_max``."""
        suffix = "_max" if self.maximize else ""
        return f"{self.rule.name}_{self.master.spec.name}_{self.moments.spec.name}{suffix}"

    @functools.cached_property
    def moment_tensors(self) -> tuple[StateTensor, ...]:
        """The moments' state tensors, in the order the step takes them."""
        return self.moments.spec.state_for(self.rule.slots)


def step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    master_state: Sequence[torch.Tensor],
    moment_state: Sequence[torch.Tensor],
    scalars: torch.Tensor,
    noise_key: torch.Tensor,
    *,
    family: StepFamily,
    reduce_columns: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """One step of `family`'s rule for one flattened parameter, writing every output in place.

    Args:
        param: parameter data viewed as ``family.moments.kernel_shape`` (flat, or
            one row per int8 block), 16-bit or fp32.
        grad: gradient of the same shape, any float dtype.
        master_state: master state tensors (same shape), in ``family.master.spec.state_keys`` order.
        moment_state: moment state tensors, in ``family.moment_tensors`` order.
        scalars: fp32 vector from `Rule.scalar_tensor`.
        noise_key: int64 0-d key of this step's stochastic-rounding noise: element
            ``i`` draws ``uniform16`` at ``i + noise_key`` (`AdamW` passes
            `step_key` of its seed and step, plus the shard's global offset);
            ignored by the other masters.
        family: the formats.
        reduce_columns: for moments with column statistics (int4) of a parameter
            sharded by rows: takes this rank's column maxima to every rank's (eager only).
    """
    value = family.master.decode(param, master_state)
    grad32 = grad.to(torch.float32)
    if family.maximize:
        grad32 = -grad32
    kinds = family.rule.kinds
    moments = family.moments.decode(moment_state, kinds)
    value, moments = family.rule.math(value, grad32, moments, scalars)
    noise = uniform16(param.shape, noise_key) if family.master.spec.uses_noise else None
    new_param, new_master = family.master.encode(value, dtype=param.dtype, noise=noise)
    param.copy_(new_param)
    for dst, src in zip(master_state, new_master, strict=True):
        dst.copy_(src)
    if reduce_columns is None:
        encoded = family.moments.encode(moments, kinds)
    else:
        encoded = family.moments.encode(moments, kinds, reduce_columns)  # type: ignore[call-arg]
    for dst, src in zip(moment_state, encoded, strict=True):
        dst.copy_(src)


StepFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        Sequence[torch.Tensor],
        Sequence[torch.Tensor],
        torch.Tensor,
        torch.Tensor,
    ],
    None,
]


@functools.cache
def family_function(family: StepFamily) -> StepFn:
    def step_fn(
        param: torch.Tensor,
        grad: torch.Tensor,
        master_state: Sequence[torch.Tensor],
        moment_state: Sequence[torch.Tensor],
        scalars: torch.Tensor,
        noise_key: torch.Tensor,
    ) -> None:
        step_(param, grad, master_state, moment_state, scalars, noise_key, family=family)

    # Dynamo keeps its compile cache (and its recompile limit) per code object;
    # a renamed copy gives each family its own budget instead of sharing one.
    name = f"mixprec_step_{family.name}"
    code = step_fn.__code__.replace(co_name=name)
    fn = types.FunctionType(code, step_fn.__globals__, name, None, step_fn.__closure__)
    return fn


@functools.cache
def compiled_family_function(family: StepFamily) -> StepFn:
    # One compiled function per family for the whole process, so a new
    # optimizer (or one rebuilt to load a checkpoint) reuses its graphs.
    return compile_fn(family_function(family))


@functools.cache
def warn_native_unavailable(reason: str) -> None:
    # Once per process and reason: every optimizer would otherwise repeat it.
    warnings.warn(
        f"mixprec optimizers: the native CPU kernel is unavailable ({reason}); "
        "using torch.compile for fused steps instead (same results, slower on CPU).",
        RuntimeWarning,
        stacklevel=4,
    )
