"""mixprec: mixed-precision training for PyTorch that is fast, correct by default, and provable.

Start with `Precision` (the runtime) and `preset` (the named policies)::

    import mixprec
    prec = mixprec.Precision("bf16_master")
    policy = mixprec.preset("bf16_master").replace(reduce_dtype=torch.float32)

The names below are the whole top level; the subpackages that are API
(`mixprec.optim`, `mixprec.checkpoint`, `mixprec.doctor`, ...) are listed in
docs/architecture.md ("Public surface"). Names are imported on first use
(PEP 562), so ``import mixprec`` (and the command line, which must answer
Ctrl-C with one line even while torch loads) starts without importing torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from mixprec.version import __version__ as __version__

if TYPE_CHECKING:
    from mixprec.device import device_caps as device_caps
    from mixprec.engine import Precision as Precision
    from mixprec.engine import StepReport as StepReport
    from mixprec.errors import PerformanceWarning as PerformanceWarning
    from mixprec.errors import PrecisionError as PrecisionError
    from mixprec.errors import PrecisionWarning as PrecisionWarning
    from mixprec.experiment.compare import compare as compare
    from mixprec.experiment.compare import rerender
    from mixprec.experiment.training import train as train
    from mixprec.policy import Float8Training as Float8Training
    from mixprec.policy import LossScaling as LossScaling
    from mixprec.policy import Policy as Policy
    from mixprec.policy import preset as preset

    report = rerender

#: The public names -> the module that defines them (``module:attribute`` when named
#: differently). The imports above are what type checkers read; a test keeps both equal.
_EXPORTS = {
    "Precision": "mixprec.engine",
    "StepReport": "mixprec.engine",
    "Policy": "mixprec.policy",
    "LossScaling": "mixprec.policy",
    "Float8Training": "mixprec.policy",
    "preset": "mixprec.policy",
    "PrecisionError": "mixprec.errors",
    "PrecisionWarning": "mixprec.errors",
    "PerformanceWarning": "mixprec.errors",
    "compare": "mixprec.experiment.compare",
    "report": "mixprec.experiment.compare:rerender",
    "train": "mixprec.experiment.training",
    "device_caps": "mixprec.device",
}

__all__ = sorted(_EXPORTS)

#: Subpackages that are API, reachable as attributes (``mixprec.optim.AdamW``).
_SUBPACKAGES = frozenset(
    {
        "checkpoint",
        "device",
        "distributed",
        "doctor",
        "dtypes",
        "engine",
        "errors",
        "experiment",
        "formats",
        "memory",
        "optim",
        "policy",
        "speed",
        "tracking",
        "workloads",
    }
)

#: Names that left the top level (issue 32: a small public surface) -> their home.
#: They still resolve, with a DeprecationWarning; remove them in the next release.
_MOVED = {
    "ALIASES": "mixprec.policy",
    "PRESET_NAMES": "mixprec.policy",
    "preset_names": "mixprec.policy",
    "resolve_auto": "mixprec.policy",
    "DeviceCaps": "mixprec.device",
    "FormatInfo": "mixprec.dtypes",
    "dtype_name": "mixprec.dtypes",
    "format_info": "mixprec.dtypes",
    "parse_dtype": "mixprec.dtypes",
    "PrecisionPlan": "mixprec.engine",
    "PrecisionStats": "mixprec.engine",
    "StepObserver": "mixprec.engine",
    "Results": "mixprec.experiment.compare",
}

#: Internal modules that were reachable as attributes until issue 32: import them
#: explicitly (a warning here would also fire on `from mixprec import islands`).
_INTERNAL = frozenset({"islands", "safe_yaml", "telemetry", "userdirs"})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, _, attribute = _EXPORTS[name].partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"mixprec.{name}")
    elif name in _MOVED:
        warnings.warn(
            f"mixprec.{name} is deprecated; use {_MOVED[name]}.{name} "
            f"(from {_MOVED[name]} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    elif name in _INTERNAL:  # an AttributeError: `from mixprec import islands` imports it
        raise AttributeError(
            f"module 'mixprec' has no attribute {name!r}: mixprec.{name} is internal "
            f"(no compatibility promise); import mixprec.{name} explicitly"
        )
    else:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})
