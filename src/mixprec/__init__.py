"""mixprec: mixed-precision training for PyTorch that is fast, correct by default, and provable.

Start with `Precision` (the runtime) and `policy` (the presets)::

    import mixprec
    prec = mixprec.Precision("bf16_master")

Names are imported on first use (PEP 562), so ``import mixprec`` (and the
command line, which must answer Ctrl-C with one line even while torch loads)
starts without importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.device import DeviceCaps, device_caps
    from mixprec.dtypes import FormatInfo, dtype_name, format_info, parse_dtype
    from mixprec.engine import Precision, PrecisionPlan, PrecisionStats, StepObserver, StepReport
    from mixprec.errors import PerformanceWarning, PrecisionError, PrecisionWarning
    from mixprec.experiment.compare import Results, compare
    from mixprec.experiment.compare import rerender as report
    from mixprec.experiment.training import train
    from mixprec.policy import (
        ALIASES,
        PRESET_NAMES,
        Float8Training,
        LossScaling,
        Policy,
        policy,
        preset_names,
        resolve_auto,
    )

#: Public name -> the module that defines it (``module:attribute`` when named differently).
_EXPORTS = {
    "DeviceCaps": "mixprec.device",
    "device_caps": "mixprec.device",
    "FormatInfo": "mixprec.dtypes",
    "dtype_name": "mixprec.dtypes",
    "format_info": "mixprec.dtypes",
    "parse_dtype": "mixprec.dtypes",
    "Precision": "mixprec.engine",
    "PrecisionPlan": "mixprec.engine",
    "PrecisionStats": "mixprec.engine",
    "StepObserver": "mixprec.engine",
    "StepReport": "mixprec.engine",
    "PerformanceWarning": "mixprec.errors",
    "PrecisionError": "mixprec.errors",
    "PrecisionWarning": "mixprec.errors",
    "Results": "mixprec.experiment.compare",
    "compare": "mixprec.experiment.compare",
    "report": "mixprec.experiment.compare:rerender",
    "train": "mixprec.experiment.training",
    "ALIASES": "mixprec.policy",
    "PRESET_NAMES": "mixprec.policy",
    "Float8Training": "mixprec.policy",
    "LossScaling": "mixprec.policy",
    "Policy": "mixprec.policy",
    "policy": "mixprec.policy",
    "preset_names": "mixprec.policy",
    "resolve_auto": "mixprec.policy",
}

#: Subpackages reachable as attributes (``mixprec.optim.AdamW`` after ``import mixprec``).
_SUBMODULES = (
    "checkpoint",
    "device",
    "distributed",
    "doctor",
    "dtypes",
    "engine",
    "errors",
    "experiment",
    "formats",
    "islands",
    "memory",
    "optim",
    "policy",
    "safe_yaml",
    "speed",
    "telemetry",
    "userdirs",
    "workloads",
)

__all__ = [
    "ALIASES",
    "PRESET_NAMES",
    "DeviceCaps",
    "Float8Training",
    "FormatInfo",
    "LossScaling",
    "PerformanceWarning",
    "Policy",
    "Precision",
    "PrecisionError",
    "PrecisionPlan",
    "PrecisionStats",
    "PrecisionWarning",
    "Results",
    "StepObserver",
    "StepReport",
    "compare",
    "device_caps",
    "dtype_name",
    "format_info",
    "parse_dtype",
    "policy",
    "preset_names",
    "report",
    "resolve_auto",
    "train",
]
from mixprec.version import __version__ as __version__  # noqa: E402


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, _, attribute = _EXPORTS[name].partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"mixprec.{name}")
    else:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


class _Package(types.ModuleType):
    """`mixprec.policy` is the preset function (the contract), while the module that
    defines it is also named `policy`: importing that submodule would make the import
    system set the package attribute to the module. Keep the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "policy" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
