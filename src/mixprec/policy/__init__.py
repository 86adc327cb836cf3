"""Precision policies: every precision decision of a training run, explicit and validated.

`definition` holds `Policy` and `LossScaling` (plain data, validated, the config
edge `Policy.from_dict`); `fp8` the FP8 settings of a policy (`Float8Training`);
`presets` the named policies, other tools' spellings of them and ``auto``.
"""

from mixprec.policy.definition import DEFAULT_FP32_MODULES, LossScaling, Policy
from mixprec.policy.fp8 import FP8_RECIPES, Float8Training
from mixprec.policy.presets import (
    ALIASES,
    AUTO_CANDIDATES,
    FP8_PRESET_NAMES,
    PRESET_NAMES,
    policy,
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
    "policy",
    "preset_names",
    "resolve_auto",
]
