"""`Policy` and `LossScaling`: every precision decision of a training run, as plain data.

A `Policy` says separately how activations are computed (`compute_dtype`),
how parameters are stored (`param_dtype`), how the optimizer keeps full
precision (`master`) and its moments (`moments`), how gradients are reduced
across ranks (`reduce_dtype`) and summed over the micro-batches of a step
(`grad_accum_dtype`), what dtype modules return under FSDP2 (`output_dtype`),
whether the loss is scaled (`loss_scaling`), which modules stay in fp32
(`fp32_modules`), whether linear layers train in FP8 (`fp8`, a
`Float8Training`), and whether each parameter is stepped as soon as its gradient
is complete (`release_gradients`). A single "mixed precision on" flag hides
exactly the decisions that break runs; here each one is visible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import dtype_name, is_16bit, parse_dtype
from mixprec.formats import check_master, check_moments, master_spec, master_specs
from mixprec.policy.fp8 import Float8Training

__all__ = ["DEFAULT_FP32_MODULES", "LossScaling", "Policy"]

#: Class-name patterns of modules kept in fp32 storage by default: every norm layer
#: (LayerNorm, RMSNorm, GroupNorm, BatchNorm1d/2d/3d, InstanceNorm*, LlamaRMSNorm...).
DEFAULT_FP32_MODULES: tuple[str, ...] = ("*Norm", "*Norm1d", "*Norm2d", "*Norm3d")

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Loss-scaling settings, as understood by `torch.amp.GradScaler`.

    Attributes:
        init_scale: the initial (or, when not dynamic, the fixed) loss scale.
        growth_factor: the scale is multiplied by this after `growth_interval`
            consecutive steps without inf/NaN gradients.
        backoff_factor: the scale is multiplied by this on a step with inf/NaN
            gradients (which is skipped).
        growth_interval: finite steps between growths.
        dynamic: False for a static scale: overflowing steps are still skipped,
            but the scale never changes.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    dynamic: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be True or False, got {self.dynamic!r}")
        try:
            init_scale = float(self.init_scale)
        except OverflowError:
            raise ValueError(
                f"init_scale must be finite and > 0, got {self.init_scale!r}"
            ) from None
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be finite and > 0, got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        interval = self.growth_interval
        if isinstance(interval, bool) or not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")

    @classmethod
    def static(cls, scale: float) -> LossScaling:
        """A fixed loss scale: non-finite steps are skipped, the scale never moves."""
        return cls(init_scale=float(scale), dynamic=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Every precision decision of a training run.

    Construct with real `torch.dtype` values; strings from configs go through
    `Policy.from_dict` (or `mixprec.dtypes.parse_dtype`). Invalid combinations raise
    `ValueError` naming the fix. A policy is plain data: constructing one never
    warns; the risky-but-allowed patterns are listed by `risks`, which
    `Precision.prepare` turns into a `PrecisionWarning` where the policy is used.

    Attributes:
        name: the preset name, or ``"custom"``.
        compute_dtype: autocast dtype for eligible ops (bf16 or fp16), or None for
            no autocast (fp32 is accepted and means None).
        param_dtype: storage dtype of module parameters.
        master: how the optimizer keeps full precision for 16-bit params; one of
            ``none``, ``fp32``, ``exact``, ``remainder8``, ``kahan``, ``stochastic``.
        moments: optimizer moment storage; one of ``fp32``, ``bf16``, ``int8``.
        reduce_dtype: dtype of gradient reduction across ranks.
        grad_accum_dtype: dtype the gradients of 16-bit parameters are summed in
            over the backward passes of one step (gradient accumulation): None (the
            default) sums into ``.grad`` in the parameter's dtype, rounding at every
            micro-batch; ``torch.float32`` makes `Precision` keep an fp32 sum per
            16-bit parameter from its second backward of a step to the step, so the
            ``.grad`` the optimizer reads is that sum rounded once (4 bytes per
            16-bit parameter while a step accumulates; no effect on fp32 parameters).
        output_dtype: dtype of module outputs under FSDP2, or None to leave them.
        loss_scaling: `LossScaling` settings, or None for no loss scaling.
        fp32_modules: module types, or fnmatch patterns matched against module
            class names (any class in the MRO) and qualified names, whose
            parameters stay fp32 and whose forward runs in fp32.
        allow_unscaled: permit fp16 compute without loss scaling (for
            experiments that demonstrate gradient underflow).
        fp8: `Float8Training` settings: the eligible `nn.Linear` layers train in
            FP8 through torchao (converted by `Precision.prepare`), the rest of the
            model under the fields above; None (the default) for no FP8. Needs bf16
            compute.
        release_gradients: step each parameter during backward, as soon as its
            gradient is complete, and free that gradient (gradient release,
            docs/release.md): no gradient of the whole model is ever held, at the
            price of global-norm clipping and gradient accumulation (both refused
            under it, as are DDP and FSDP2). False (the default): the ordinary step.
        note: free text, e.g. why `auto` chose this policy. Not compared.
    """

    name: str = "custom"
    compute_dtype: torch.dtype | None = None
    param_dtype: torch.dtype = torch.float32
    master: str = "none"
    moments: str = "fp32"
    reduce_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    loss_scaling: LossScaling | None = None
    fp32_modules: tuple[type[nn.Module] | str, ...] = DEFAULT_FP32_MODULES
    allow_unscaled: bool = False
    fp8: Float8Training | None = None
    release_gradients: bool = False
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_dtype_field(
            "compute_dtype", self.compute_dtype, (torch.float32, *_COMPUTE_DTYPES), True
        )
        if self.compute_dtype == torch.float32:
            object.__setattr__(self, "compute_dtype", None)
        _check_dtype_field("param_dtype", self.param_dtype, _STORAGE_DTYPES, False)
        _check_dtype_field("reduce_dtype", self.reduce_dtype, _STORAGE_DTYPES, False)
        _check_dtype_field("output_dtype", self.output_dtype, _STORAGE_DTYPES, True)
        _check_dtype_field("grad_accum_dtype", self.grad_accum_dtype, (torch.float32,), True)
        check_master(self.master)
        check_moments(self.moments)
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError(
                f"loss_scaling must be a mixprec.LossScaling or None, got {self.loss_scaling!r}"
            )
        if not isinstance(self.allow_unscaled, bool):
            raise TypeError(f"allow_unscaled must be True or False, got {self.allow_unscaled!r}")
        if not isinstance(self.release_gradients, bool):
            raise TypeError(
                f"release_gradients must be True or False, got {self.release_gradients!r}"
            )
        if self.fp8 is not None and not isinstance(self.fp8, Float8Training):
            raise TypeError(
                f"fp8 must be a mixprec.Float8Training or None, got {self.fp8!r}; "
                "configs give a mapping through Policy.from_dict"
            )
        if isinstance(self.fp32_modules, str | type):
            raise TypeError(
                f"fp32_modules must be a tuple of module types or name patterns, got "
                f"{self.fp32_modules!r}; wrap it: fp32_modules=({self.fp32_modules!r},)"
            )
        if not isinstance(self.fp32_modules, tuple):
            try:
                object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
            except TypeError:
                raise TypeError(
                    "fp32_modules must be a tuple of module types or name patterns, got "
                    f"{self.fp32_modules!r}"
                ) from None
        for entry in self.fp32_modules:
            if not (
                isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))
            ):
                raise TypeError(
                    "fp32_modules entries must be nn.Module subclasses or name patterns, "
                    f"got {entry!r}"
                )
        self._check_combination()

    def _check_combination(self) -> None:
        where = f"policy {self.name!r}"
        if (
            self.compute_dtype == torch.float16
            and self.loss_scaling is None
            and not self.allow_unscaled
        ):
            raise ValueError(
                f"{where}: fp16 compute without loss scaling lets small gradients underflow "
                "to zero; "
                "fix: set loss_scaling=LossScaling() (dynamic), or allow_unscaled=True to study it"
            )
        spec = master_spec(self.master)
        if self.param_dtype == torch.float32 and not spec.accepts(self.param_dtype):
            raise ValueError(
                f"{where}: master={self.master!r} with fp32 params: fp32 params are already the "
                "master, so a master representation only adds memory; fix: master='none', or "
                "store params in 16 bits (param_dtype=torch.bfloat16)"
            )
        if not spec.accepts(self.param_dtype):
            needs = " or ".join(spec.param_dtypes or ())
            raise ValueError(
                f"{where}: master={self.master!r} needs {needs} params, got "
                f"{dtype_name(self.param_dtype)}; fix: param_dtype=torch.bfloat16 or master='fp32'"
            )
        if self.fp8 is not None and self.compute_dtype != torch.bfloat16:
            raise ValueError(
                f"{where}: fp8={self.fp8.recipe!r} needs bf16 compute (torchao's float8 "
                "training casts to FP8 from bf16 and runs the rest of the model in it), got "
                f"compute_dtype={dtype_name(self.compute_dtype)}; fix: "
                "compute_dtype=torch.bfloat16 (the fp8_* presets)"
            )
        if self.release_gradients and self.grad_accum_dtype is not None:
            raise ValueError(
                f"{where}: release_gradients steps each parameter during its backward, so "
                "there is no step-long sum of gradients for grad_accum_dtype to keep; fix: "
                "grad_accum_dtype=None (one backward per step), or release_gradients=False"
            )
        if self.param_dtype == torch.float16 and self.loss_scaling is not None:
            raise ValueError(
                f"{where}: fp16 parameter storage with loss scaling would unscale fp16 gradients "
                "in fp16 (torch.amp.GradScaler refuses this); fix: keep fp32 params with fp16 "
                "compute (preset 'amp_fp16') or store params in bf16"
            )

    def risks(self) -> tuple[str, ...]:
        """What this (valid) policy risks, one sentence each; empty for the safe ones.

        A policy never warns when built; `Precision.prepare` warns with these
        (`PrecisionWarning`) when it applies the policy to a model.
        """
        found: list[str] = []
        if is_16bit(self.param_dtype) and not master_spec(self.master).keeps_small_updates:
            # The cheapest exact master this parameter dtype can have (from the registry).
            exact = min(
                (s for s in master_specs() if s.exact and s.accepts(self.param_dtype)),
                key=lambda s: s.bytes_per_element,
            )
            found.append(
                f"policy {self.name!r}: parameters stored in {dtype_name(self.param_dtype)} "
                "with no master: every update (AdamW's, SGD's, Lion's, any optimizer's) is "
                f"rounded to {dtype_name(self.param_dtype)} and small ones are lost, and the "
                f"optimizer's state (moments, momentum) is stored in {self.moments}; "
                f"use master={exact.name!r} (bitwise fp32 at {exact.bytes_per_element} extra "
                "bytes/param) unless you have measured that this is acceptable"
            )
        if self.fp8 is not None and not self.fp8.skip_first_last:
            found.append(
                f"policy {self.name!r}: fp8 with skip_first_last=False converts the first and "
                "the last nn.Linear (often the input projection and the output head, the layers "
                "most sensitive to FP8's 2-3 mantissa bits) to FP8; keep them in 16 bits "
                "(skip_first_last=True) unless you have measured that this is acceptable"
            )
        return tuple(found)

    # ------------------------------------------------------------------ facts

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled before backward."""
        return self.loss_scaling is not None

    @property
    def autocast_enabled(self) -> bool:
        """Whether forward passes run under `torch.autocast`."""
        return self.compute_dtype is not None

    @property
    def effective_compute_dtype(self) -> torch.dtype:
        """The dtype eligible ops compute in: the autocast dtype or the storage dtype."""
        return self.compute_dtype if self.compute_dtype is not None else self.param_dtype

    # ------------------------------------------------------------ conversion

    def replace(self, **changes: Any) -> Policy:
        """A copy with some fields changed (validated again); name becomes ``custom``
        unless given, or unless no field changes (``bf16_lean4.replace(
        release_gradients=True)`` is still ``bf16_lean4``)."""
        if any(getattr(self, field) != value for field, value in changes.items()):
            changes.setdefault("name", "custom")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (dtypes by canonical name)."""
        return {
            "name": self.name,
            "compute_dtype": dtype_name(self.compute_dtype),
            "param_dtype": dtype_name(self.param_dtype),
            "master": self.master,
            "moments": self.moments,
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "grad_accum_dtype": dtype_name(self.grad_accum_dtype),
            "output_dtype": dtype_name(self.output_dtype),
            "loss_scaling": None if self.loss_scaling is None else self.loss_scaling.to_dict(),
            "fp32_modules": [e if isinstance(e, str) else e.__name__ for e in self.fp32_modules],
            "allow_unscaled": self.allow_unscaled,
            "fp8": None if self.fp8 is None else self.fp8.to_dict(),
            "release_gradients": self.release_gradients,
            "note": self.note,
        }

    def differences(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The fields that change what runs (``name`` and ``note`` aside) where `saved`,
        a `to_dict` from a state, checkpoint or run, differs from this policy: field ->
        (saved value, this policy's value). A field added since `saved` was written (such
        as ``grad_accum_dtype``) is read at its default, which it had then."""
        was, mine = {**Policy().to_dict(), **saved}, self.to_dict()
        keys = sorted((set(was) | set(mine)) - {"name", "note"})
        return {k: (was.get(k), mine.get(k)) for k in keys if was.get(k) != mine.get(k)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Build a policy from plain data (a YAML/JSON mapping); the config edge.

        A ``preset`` key starts from that preset (see `preset`) and the other keys
        override its fields. Dtypes are strings (``"bf16"``), ``loss_scaling`` is
        null, ``"dynamic"``, a number (a static scale) or a mapping of
        `LossScaling` fields; ``fp32_modules`` is a list of name patterns; ``fp8`` is
        null, a recipe name or a mapping of `Float8Training` fields (over a preset's
        own fp8 settings, given fields replace those fields only). Nothing is
        imported or executed.

        Raises:
            ValueError: on unknown keys or values, naming the valid ones.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"a policy must be a mapping, got {type(data).__name__}: {data!r}")
        valid = {f.name for f in dataclasses.fields(cls)} | {"preset"}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"unknown policy keys {unknown}; valid keys: {sorted(valid)}")
        values = dict(data)
        base: Policy | None = None
        if "preset" in values:
            from mixprec.policy.presets import preset  # presets are built from this class

            base = preset(str(values.pop("preset")))
        kwargs: dict[str, Any] = {}
        for key in ("compute_dtype", "output_dtype", "grad_accum_dtype"):
            if key in values:
                raw = values[key]
                kwargs[key] = (
                    None if raw is None or str(raw).lower() == "none" else parse_dtype(str(raw))
                )
        for key in ("param_dtype", "reduce_dtype"):
            if key in values:
                kwargs[key] = parse_dtype(str(values[key]))
        for key in ("name", "note"):
            if key in values:
                kwargs[key] = str(values[key])
        if "master" in values:
            kwargs["master"] = check_master(str(values["master"]))
        if "moments" in values:
            kwargs["moments"] = check_moments(str(values["moments"]))
        for key in ("allow_unscaled", "release_gradients"):
            if key in values:
                kwargs[key] = _parse_bool(key, values[key])
        if "loss_scaling" in values:
            kwargs["loss_scaling"] = _parse_loss_scaling(values["loss_scaling"])
        if "fp32_modules" in values:
            raw_modules = values["fp32_modules"]
            if not isinstance(raw_modules, list | tuple) or not all(
                isinstance(m, str) for m in raw_modules
            ):
                raise ValueError(
                    f"fp32_modules must be a list of name patterns, got {raw_modules!r}"
                )
            kwargs["fp32_modules"] = tuple(raw_modules)
        if "fp8" in values:
            raw_fp8 = values["fp8"]
            if base is not None and base.fp8 is not None and isinstance(raw_fp8, Mapping):
                raw_fp8 = {**base.fp8.to_dict(), **raw_fp8}
            kwargs["fp8"] = Float8Training.from_dict(raw_fp8)
        if base is not None:
            kwargs.setdefault("name", base.name if len(kwargs) == 0 else "custom")
            return dataclasses.replace(base, **kwargs)
        return cls(**kwargs)

    def describe(self) -> str:
        """A one-line summary such as ``compute bf16, params bf16, master exact, ...``."""
        scaling = "none"
        if self.loss_scaling is not None:
            scaling = (
                "dynamic"
                if self.loss_scaling.dynamic
                else f"static {self.loss_scaling.init_scale:g}"
            )
        fp8 = "" if self.fp8 is None else f", fp8 linears {self.fp8.recipe}"
        accum = (
            ""
            if self.grad_accum_dtype is None
            else f", accumulate grads {dtype_name(self.grad_accum_dtype)}"
        )
        release = ", gradients released in backward" if self.release_gradients else ""
        return (
            f"compute {dtype_name(self.compute_dtype)}, params {dtype_name(self.param_dtype)}, "
            f"master {self.master}, moments {self.moments}, "
            f"reduce {dtype_name(self.reduce_dtype)}{accum}, "
            f"loss scaling {scaling}{fp8}{release}"
        )


def _check_dtype_field(
    name: str, value: object, allowed: tuple[torch.dtype, ...], optional: bool
) -> None:
    if value is None and optional:
        return
    if isinstance(value, str):
        raise TypeError(
            f"{name}={value!r} is a string; Policy takes torch.dtype values "
            f"(use mixprec.dtypes.parse_dtype({value!r}) or Policy.from_dict for configs)"
        )
    if value not in allowed:
        choices = [dtype_name(d) for d in allowed] + (["None (null)"] if optional else [])
        shown = dtype_name(value) if isinstance(value, torch.dtype) else repr(value)
        raise ValueError(f"{name}={shown} is not supported; valid: {', '.join(choices)}")


def _parse_bool(key: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    raise ValueError(f"{key} must be true or false, got {raw!r}")


def _parse_loss_scaling(raw: object) -> LossScaling | None:
    if raw is None or raw is False or (isinstance(raw, str) and raw.lower() in ("none", "off")):
        return None
    if raw is True or (isinstance(raw, str) and raw.lower() == "dynamic"):
        return LossScaling()
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return LossScaling.static(float(raw))
    if isinstance(raw, Mapping):
        valid = {f.name for f in dataclasses.fields(LossScaling)}
        unknown = sorted(set(raw) - valid)
        if unknown:
            raise ValueError(f"unknown loss_scaling keys {unknown}; valid keys: {sorted(valid)}")
        return LossScaling(**dict(raw))
    raise ValueError(
        f"loss_scaling must be null, 'dynamic', a number (static scale) or a mapping, got {raw!r}"
    )
