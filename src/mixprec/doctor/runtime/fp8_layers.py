"""Which modules of a model are fp8 layers, and what each casts to fp8.

A torchao ``Float8Linear`` (``torchao.float8.convert_to_float8_training``) casts
three tensors: its input activation and its weight in forward, the gradient of its
output in backward. Each is cast once per matmul it enters (``output``,
``grad_input``, ``grad_weight``) under that matmul's ``CastConfig``: a target dtype
(e4m3fn by default, e5m2 for the output gradient in the ``tensorwise`` recipe), a
granularity (one scale per tensor, or per row/column: ``axiswise``) and whether it
is cast at all (``rowwise_with_gw_hp`` keeps the grad-weight matmul in high
precision). `fp8_layers` reads that from each module's ``config`` by attribute,
without importing torchao, so the doctor recognises the modules whether or not
torchao is importable here.

Each cast is measured on a 2-D view: the input as ``(-1, in_features)``, the weight
as ``(out_features, in_features)``, the output gradient as ``(-1, out_features)``.
``reduce_dim`` is the dimension an axiswise amax reduces over in that view
(torchao's ``axiswise_dim`` on the tensor it casts: the weight is cast transposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mixprec.engine.fp8 import is_float8_linear

__all__ = ["CastPlan", "Fp8Layer", "Gemm", "Role", "fp8_layers"]

Role = Literal["input", "weight", "grad_output"]
Gemm = Literal["output", "grad_input", "grad_weight"]

#: (role, gemm, the config attribute, reduce_dim of an axiswise cast in the 2-D view),
#: as `torchao.float8.float8_linear.matmul_with_hp_or_float8_args` casts them.
_CASTS: tuple[tuple[Role, Gemm, str, int], ...] = (
    ("input", "output", "cast_config_input", 1),
    ("weight", "output", "cast_config_weight", 1),
    ("grad_output", "grad_input", "cast_config_grad_output", 1),
    ("weight", "grad_input", "cast_config_weight_for_grad_input", 0),
    ("grad_output", "grad_weight", "cast_config_grad_output_for_grad_weight", 0),
    ("input", "grad_weight", "cast_config_input_for_grad_weight", 0),
)


@dataclass(frozen=True, kw_only=True)
class CastPlan:
    """One distinct fp8 cast of one tensor of a layer.

    Attributes:
        role: which tensor: ``input``, ``weight`` or ``grad_output``.
        gemms: the matmuls that use this cast (identical casts are measured once).
        dtype: the fp8 target dtype.
        granularity: ``tensorwise`` (one scale) or ``axiswise`` (one per row/column).
        reduce_dim: for ``axiswise``, the dimension of the 2-D view the amax reduces
            over; None for ``tensorwise``.
        round_pow2: whether scales are rounded down to a power of two.
    """

    role: Role
    gemms: tuple[Gemm, ...]
    dtype: torch.dtype
    granularity: Literal["tensorwise", "axiswise"]
    reduce_dim: int | None
    round_pow2: bool


@dataclass(frozen=True, kw_only=True)
class Fp8Layer:
    """An fp8 layer of a model.

    Attributes:
        name: its qualified name in the model.
        module: the module.
        recipe: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp`` (torchao's recipe
            names, recognised from the casts) or ``custom``.
        emulate: whether its matmuls are emulated (``Float8LinearConfig.emulate``).
        casts: the distinct casts it makes.
        high_precision_gemms: matmuls it runs without fp8 (casts disabled).
    """

    name: str
    module: nn.Module
    recipe: str
    emulate: bool
    casts: tuple[CastPlan, ...]
    high_precision_gemms: tuple[Gemm, ...]

    def casts_of(self, role: Role) -> tuple[CastPlan, ...]:
        """The casts of one tensor role."""
        return tuple(c for c in self.casts if c.role == role)


def _value(obj: object) -> str:
    """An enum's ``.value`` (torchao's ScalingType/ScalingGranularity), else str."""
    return str(getattr(obj, "value", obj)).lower()


def _plan(module: nn.Module) -> tuple[tuple[CastPlan, ...], tuple[Gemm, ...]]:
    config = module.config
    round_pow2 = bool(getattr(config, "round_scales_to_power_of_2", False))
    merged: dict[tuple[object, ...], CastPlan] = {}
    disabled: list[Gemm] = []
    for role, gemm, attr, dim in _CASTS:
        cc = getattr(config, attr, None)
        if cc is None:
            continue
        if _value(getattr(cc, "scaling_type", "dynamic")) == "disabled":
            if gemm not in disabled:
                disabled.append(gemm)
            continue
        dtype = getattr(cc, "target_dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn
        axiswise = _value(getattr(cc, "scaling_granularity", "tensorwise")) == "axiswise"
        reduce_dim = dim if axiswise else None
        key = (role, dtype, axiswise, reduce_dim)
        old = merged.get(key)
        merged[key] = CastPlan(
            role=role,
            gemms=(*old.gemms, gemm) if old is not None else (gemm,),
            dtype=dtype,
            granularity="axiswise" if axiswise else "tensorwise",
            reduce_dim=reduce_dim,
            round_pow2=round_pow2,
        )
    return tuple(merged.values()), tuple(disabled)


def _recipe(casts: tuple[CastPlan, ...], disabled: tuple[Gemm, ...]) -> str:
    kinds = {c.granularity for c in casts}
    if not disabled and kinds == {"tensorwise"}:
        return "tensorwise"
    if not disabled and kinds == {"axiswise"}:
        return "rowwise"
    if disabled == ("grad_weight",) and all(c.dtype == torch.float8_e4m3fn for c in casts):
        return "rowwise_with_gw_hp"
    return "custom"


def fp8_layers(model: nn.Module | None) -> tuple[Fp8Layer, ...]:
    """The fp8 layers of `model` (torchao ``Float8Linear`` modules), in module order."""
    if model is None:
        return ()
    found = []
    for name, module in model.named_modules():
        if not is_float8_linear(module):
            continue
        casts, disabled = _plan(module)
        found.append(
            Fp8Layer(
                name=name or "<model>",
                module=module,
                recipe=_recipe(casts, disabled),
                emulate=bool(getattr(module.config, "emulate", False)),
                casts=casts,
                high_precision_gemms=disabled,
            )
        )
    return tuple(found)
