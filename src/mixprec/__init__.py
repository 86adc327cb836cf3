"""mixprec: mixed-precision training for PyTorch that is fast, correct by default, and provable.

Start with `Precision` (the runtime) and `policy` (the presets)::

    import mixprec
    prec = mixprec.Precision("bf16_master")
"""

from mixprec.device import DeviceCaps, device_caps
from mixprec.dtypes import FormatInfo, dtype_name, format_info, parse_dtype
from mixprec.engine import Precision, PrecisionStats, StepObserver, StepReport
from mixprec.errors import PerformanceWarning, PrecisionError, PrecisionWarning
from mixprec.experiment.compare import Results, compare
from mixprec.policy import (
    ALIASES,
    PRESET_NAMES,
    LossScaling,
    Policy,
    policy,
    preset_names,
    resolve_auto,
)

__all__ = [
    "ALIASES",
    "PRESET_NAMES",
    "DeviceCaps",
    "FormatInfo",
    "LossScaling",
    "PerformanceWarning",
    "Policy",
    "Precision",
    "PrecisionError",
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
    "resolve_auto",
]
__version__ = "0.1.0"
