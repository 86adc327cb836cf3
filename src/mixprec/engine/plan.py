"""`PrecisionPlan`: a policy read once into what the engine will do.

`Precision` resolves its `Policy` into a plan when it is built (`resolve_plan`):
the autocast dtype, the storage dtype, the fp32 island rule, the master and
moment formats (their specs from the format registry), the loss-scaler settings
and the gradient-reduction dtype. Every later call (`prepare`, `autocast`,
`optimizer`, `backward`, `step`) reads the plan; none goes back to the policy.

Under a policy with `Policy.fp8` the plan also holds its `Float8Training`:
`prepare` converts the eligible linear layers (`mixprec.engine.fp8`) after the
storage dtypes and islands are set, and records what it did (`Precision.fp8`).

The gradient-reduction and output dtypes are applied by the data-parallel
wrappers (`mixprec.distributed.shard`/`ddp`); `Precision.prepare` refuses a
wrapped model whose wrappers do otherwise (`mixprec.engine.wrappers`).

The plan does not hold the device: `Precision` learns it from the model in
`prepare` (or is told), and checks there and in `autocast` that the device can
compute in `autocast_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.formats import MasterSpec, MomentSpec, master_spec, moment_spec
from mixprec.islands import IslandRule
from mixprec.policy import Float8Training, LossScaling, Policy

__all__ = ["PrecisionPlan", "resolve_plan"]


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    """What a run does, resolved once from its `Policy` (see `resolve_plan`).

    Two equal policies give equal plans.

    Attributes:
        policy_name: the policy's name, for messages.
        autocast_dtype: the dtype eligible ops compute in under `Precision.autocast`,
            or None: no autocast (ops compute in the storage dtype).
        storage_dtype: the dtype `Precision.prepare` stores parameters in (fp32
            islands apart).
        islands: which modules keep fp32 parameters and run in fp32 (active under
            16-bit storage only).
        master: the master-weight format of 16-bit parameters (fp32 parameters
            need none), from the format registry.
        moments: the optimizer's moment format, from the format registry.
        loss_scaling: the `torch.amp.GradScaler` settings, or None: no loss scaling.
        reduce_dtype: the dtype gradients are reduced in across ranks (applied by
            `mixprec.distributed.shard`/`ddp`; checked by `Precision.prepare`).
        output_dtype: the dtype an FSDP2 root casts the model's outputs to, or None.
        grad_accum_dtype: the dtype 16-bit parameters' gradients are summed in over
            the backward passes of a step (`mixprec.engine.accumulation`), or None:
            in ``.grad``, in the parameter's dtype.
        fp8: the FP8 settings of the linear layers (`Float8Training`), or None: no FP8.
        release_gradients: step each parameter from its gradient hook during backward
            and free the gradient (`mixprec.engine.release`, docs/release.md).
        risks: what the policy risks, one sentence each; `Precision.prepare` warns
            with them (`PrecisionWarning`).
    """

    policy_name: str
    autocast_dtype: torch.dtype | None
    storage_dtype: torch.dtype
    islands: IslandRule
    master: MasterSpec
    moments: MomentSpec
    loss_scaling: LossScaling | None
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype | None = None
    grad_accum_dtype: torch.dtype | None = None
    fp8: Float8Training | None = None
    release_gradients: bool = False
    risks: tuple[str, ...] = ()

    @property
    def autocast_enabled(self) -> bool:
        """Whether forward passes run under `torch.autocast`."""
        return self.autocast_dtype is not None

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled before backward."""
        return self.loss_scaling is not None

    @property
    def dynamic_scaling(self) -> bool:
        """Whether the loss scale moves (backs off on overflow, grows when clean)."""
        return self.loss_scaling is not None and self.loss_scaling.dynamic

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (dtypes and formats by name)."""
        return {
            "autocast_dtype": dtype_name(self.autocast_dtype),
            "storage_dtype": dtype_name(self.storage_dtype),
            "fp32_modules": [e if isinstance(e, str) else e.__name__ for e in self.islands.entries],
            "islands_active": self.islands.active,
            "master": self.master.name,
            "moments": self.moments.name,
            "loss_scaling": None if self.loss_scaling is None else self.loss_scaling.to_dict(),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "output_dtype": dtype_name(self.output_dtype),
            "grad_accum_dtype": dtype_name(self.grad_accum_dtype),
            "fp8": None if self.fp8 is None else self.fp8.to_dict(),
            "release_gradients": self.release_gradients,
        }

    def describe(self) -> str:
        """A few lines, one decision each (what `Precision.summary` prints)."""
        if self.autocast_dtype is None:
            autocast = f"off (ops compute in {dtype_name(self.storage_dtype)})"
        else:
            autocast = dtype_name(self.autocast_dtype)
        return "\n".join(
            [
                f"autocast: {autocast}",
                f"parameter storage: {dtype_name(self.storage_dtype)}",
                f"fp32 islands: {self.islands.describe()}",
                f"master: {self.master.name} ({self.master.summary})",
                f"moments: {self.moments.name} ({self.moments.summary})",
                f"loss scaling: {_scaling_text(self.loss_scaling)}",
                f"gradient reduction across ranks: {dtype_name(self.reduce_dtype)}",
                f"gradient accumulation over micro-batches: {_accum_text(self)}",
            ]
            + (
                []
                if self.output_dtype is None
                else [f"FSDP2 output cast: {dtype_name(self.output_dtype)}"]
            )
            + ([] if self.fp8 is None else [f"linear layers: {self.fp8.describe()}"])
            + (
                ["gradients: released (each parameter stepped in backward, its gradient freed)"]
                if self.release_gradients
                else []
            )
        )


def _accum_text(plan: PrecisionPlan) -> str:
    if plan.storage_dtype == torch.float32:
        return "fp32 (in .grad)"
    if plan.grad_accum_dtype is None:
        return f"{dtype_name(plan.storage_dtype)} (in .grad, rounded at every backward)"
    return f"{dtype_name(plan.grad_accum_dtype)} (a sum per 16-bit parameter, rounded once)"


def _scaling_text(ls: LossScaling | None) -> str:
    if ls is None:
        return "none"
    if not ls.dynamic:
        return f"static {ls.init_scale:g} (overflowing steps are skipped)"
    return (
        f"dynamic from {ls.init_scale:g} (x{ls.backoff_factor:g} on overflow, "
        f"x{ls.growth_factor:g} after {ls.growth_interval} clean steps)"
    )


def resolve_plan(policy: Policy) -> PrecisionPlan:
    """Read `policy` into a `PrecisionPlan`."""
    return PrecisionPlan(
        policy_name=policy.name,
        autocast_dtype=policy.compute_dtype,
        storage_dtype=policy.param_dtype,
        islands=IslandRule.of(policy),
        master=master_spec(policy.master),
        moments=moment_spec(policy.moments),
        loss_scaling=policy.loss_scaling,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        grad_accum_dtype=policy.grad_accum_dtype,
        fp8=policy.fp8,
        release_gradients=policy.release_gradients,
        risks=policy.risks(),
    )
