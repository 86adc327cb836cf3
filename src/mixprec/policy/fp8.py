"""`Float8Training`: how a policy trains its linear layers in FP8, as plain data.

FP8 in mixprec is torchao's float8 training (`torchao.float8`): the eligible
`nn.Linear` layers of a model are swapped for torchao's ``Float8Linear`` by
`Precision.prepare`, whose three GEMMs (output, grad_input, grad_weight) take
FP8 operands scaled per tensor or per row; everything else runs under the
policy's 16-bit settings. This module only says *what* is asked: the recipe,
whether the GEMMs are emulated, and which layers convert. It imports neither
torchao nor the engine (`mixprec.engine.fp8` executes it).

Scaling is dynamic ("current") in every recipe: each cast computes its scale from
the tensor's own amax at that moment. torchao 0.18 has no delayed scaling
(``ScalingType`` is ``DYNAMIC`` or ``DISABLED``); Transformer Engine's
``DelayedScaling`` (a scale from an amax history) is reproduced only in the
doctor's FP8 probe, to show what it would have done.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["FP8_RECIPES", "Float8Training"]

#: torchao's recipe names (``Float8LinearRecipeName``), and what each casts to FP8.
FP8_RECIPES: Mapping[str, str] = MappingProxyType(
    {
        "tensorwise": (
            "one scale per tensor; input and weight in e4m3, grad_output in e5m2; "
            "all three GEMMs in FP8"
        ),
        "rowwise": (
            "one scale per row (power of two); input, weight and grad_output in e4m3; "
            "all three GEMMs in FP8"
        ),
        "rowwise_with_gw_hp": (
            "rowwise for output and grad_input (grad_output in e4m3, weight tensorwise for "
            "grad_input); grad_weight computed in high precision (16-bit)"
        ),
    }
)

_FIELDS = ("recipe", "emulate", "min_divisor", "skip_first_last", "exclude")


@dataclass(frozen=True, kw_only=True)
class Float8Training:
    """FP8 training of linear layers through torchao (see the module docs).

    Attributes:
        recipe: torchao's recipe name: ``tensorwise``, ``rowwise`` or
            ``rowwise_with_gw_hp`` (`FP8_RECIPES`); every one scales dynamically.
        emulate: None (auto): real FP8 GEMMs (``torch._scaled_mm``) only on CUDA
            devices of capability 8.9 or more, torchao's emulation elsewhere (every
            CPU). True: always emulate (numerics only, no speed). False: always
            real FP8 GEMMs (fails where the device has no FP8 units).
        min_divisor: a layer converts only if both its in and out features are
            divisible by this (16: what ``torch._scaled_mm`` needs). Values that
            are not a multiple of 16 need ``emulate=True``.
        skip_first_last: keep the first and the last `nn.Linear` of the model (in
            ``model.named_modules()`` order; often an input projection and the
            output head, the layers most sensitive to FP8) in 16 bits.
        exclude: fnmatch patterns on qualified module names (``"blocks.0.*"``,
            ``"*.head"``); matching layers stay in 16 bits.
    """

    recipe: str = "tensorwise"
    emulate: bool | None = None
    min_divisor: int = 16
    skip_first_last: bool = True
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str) or self.recipe not in FP8_RECIPES:
            raise ValueError(
                f"unknown fp8 recipe {self.recipe!r}; valid recipes: {', '.join(FP8_RECIPES)}"
            )
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise TypeError(f"emulate must be True, False or None (auto), got {self.emulate!r}")
        divisor = self.min_divisor
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"min_divisor must be an int >= 1, got {self.min_divisor!r}")
        if divisor % 16 and self.emulate is not True:
            raise ValueError(
                f"min_divisor={divisor}: real FP8 GEMMs (torch._scaled_mm) need both "
                "dimensions divisible by 16; fix: min_divisor=16 (or a multiple of it), or "
                "emulate=True to study numerics only"
            )
        if not isinstance(self.skip_first_last, bool):
            raise TypeError(f"skip_first_last must be True or False, got {self.skip_first_last!r}")
        if isinstance(self.exclude, str):
            raise TypeError(
                f"exclude must be a tuple of name patterns, got {self.exclude!r}; wrap it: "
                f"exclude=({self.exclude!r},)"
            )
        try:
            patterns = tuple(self.exclude)
        except TypeError:
            raise TypeError(
                f"exclude must be a tuple of name patterns, got {self.exclude!r}"
            ) from None
        if not all(isinstance(p, str) and p for p in patterns):
            raise TypeError(f"exclude entries must be non-empty name patterns, got {patterns!r}")
        object.__setattr__(self, "exclude", patterns)

    # ------------------------------------------------------------------ facts

    def excludes(self, qualified_name: str) -> str | None:
        """The first `exclude` pattern that matches `qualified_name`, else None."""
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(qualified_name, pattern):
                return pattern
        return None

    def describe(self) -> str:
        """One line such as ``fp8 tensorwise (dynamic scaling), emulate auto, ...``."""
        emulate = {None: "auto", True: "always", False: "never"}[self.emulate]
        ends = "first/last kept 16-bit" if self.skip_first_last else "first/last converted"
        excluded = f", exclude {', '.join(self.exclude)}" if self.exclude else ""
        return (
            f"fp8 {self.recipe} (dynamic scaling), emulate {emulate}, "
            f"dims divisible by {self.min_divisor}, {ends}{excluded}"
        )

    # ------------------------------------------------------------ conversion

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        out = dataclasses.asdict(self)
        out["exclude"] = list(self.exclude)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str | bool | None) -> Float8Training | None:
        """From plain data: a mapping of fields, a recipe name (``"rowwise"``), or
        null/false for no FP8 (True means the defaults).

        Raises:
            ValueError: unknown keys or values, naming the valid ones.
        """
        if data is None or data is False:
            return None
        if data is True:
            return cls()
        if isinstance(data, str):
            if data.strip().lower() in ("none", "off", "false"):
                return None
            return cls(recipe=data.strip())
        if not isinstance(data, Mapping):
            raise ValueError(
                f"fp8 must be null, a recipe name ({', '.join(FP8_RECIPES)}) or a mapping "
                f"of {', '.join(_FIELDS)}; got {data!r}"
            )
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown fp8 keys {unknown}; valid keys: {sorted(_FIELDS)}")
        values = dict(data)
        if "emulate" in values and isinstance(values["emulate"], str):
            raw = values["emulate"].strip().lower()
            if raw not in ("auto", "none"):
                raise ValueError(f"fp8 emulate must be true, false or auto, got {raw!r}")
            values["emulate"] = None
        if "exclude" in values:
            raw_exclude = values["exclude"]
            if isinstance(raw_exclude, str):
                raw_exclude = [raw_exclude]
            if not isinstance(raw_exclude, list | tuple):
                raise ValueError(
                    f"fp8 exclude must be a list of name patterns, got {raw_exclude!r}"
                )
            values["exclude"] = tuple(raw_exclude)
        try:
            return cls(**values)
        except TypeError as exc:  # a wrong type from YAML: a bad value, exit 2
            raise ValueError(f"fp8: {exc}") from None
