"""Precision policies: every precision decision of a training run, explicit and validated.

`definition` holds `Policy` and `LossScaling` (plain data, validated, the config
edge `Policy.from_dict`); `fp8` the FP8 settings of a policy (`Float8Training`);
`presets` the named policies (`preset`), other tools' spellings of them and ``auto``.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

from mixprec.policy.definition import DEFAULT_FP32_MODULES, LossScaling, Policy
from mixprec.policy.fp8 import FP8_RECIPES, Float8Training
from mixprec.policy.presets import (
    ALIASES,
    AUTO_CANDIDATES,
    FP8_PRESET_NAMES,
    PRESET_NAMES,
    preset,
    preset_names,
    resolve_auto,
)

__all__ = [
    "ALIASES",
    "AUTO_CANDIDATES",
    "DEFAULT_FP32_MODULES",
    "FP8_PRESET_NAMES",
    "FP8_RECIPES",
    "PRESET_NAMES",
    "Float8Training",
    "LossScaling",
    "Policy",
    "preset",
    "preset_names",
    "resolve_auto",
]

_DEPRECATED_CALL = "mixprec.policy(name) is deprecated; use mixprec.preset(name)"


def __getattr__(name: str) -> Any:
    if name == "policy":  # the preset function's old name (before 0.x: issue 32)
        warnings.warn(
            "mixprec.policy.policy is deprecated; use mixprec.preset "
            "(from mixprec.policy import preset)",
            DeprecationWarning,
            stacklevel=2,
        )
        return preset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    """`mixprec.policy` was both the preset function and this package. The package
    won; calling it still returns the preset, with a DeprecationWarning naming
    `mixprec.preset`. Remove with the deprecated spelling."""

    def __call__(self, name: str | Policy, *, device: Any = None) -> Policy:
        warnings.warn(_DEPRECATED_CALL, DeprecationWarning, stacklevel=2)
        return preset(name, device=device)


sys.modules[__name__].__class__ = _CallablePackage
