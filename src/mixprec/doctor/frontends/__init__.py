"""The doctor's front ends: what turns a setup into `TrainingFacts` for the static rules.

Config files (`dispatch`: format detection and `check_file`; one module per
format: `mixprec_yaml`, `nemo_yaml`) and live objects (`live`: `check`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.doctor.frontends.dispatch import (
        FORMATS,
        FRONT_ENDS,
        ConfigFormat,
        check_config,
        check_file,
        detect_format,
        front_end,
        load_config,
    )
    from mixprec.doctor.frontends.document import ConfigDoc, read_config
    from mixprec.doctor.frontends.frontend import DeviceArg, FactsReader, FrontEnd, resolve_device
    from mixprec.doctor.frontends.live import check, facts_from_objects, optimizer_facts

#: Public name -> the module that defines it. Imported on first use (PEP 562):
#: the config front ends must not load torch, which `live` needs.
_EXPORTS = {
    "FORMATS": "mixprec.doctor.frontends.dispatch",
    "FRONT_ENDS": "mixprec.doctor.frontends.dispatch",
    "ConfigFormat": "mixprec.doctor.frontends.dispatch",
    "check_config": "mixprec.doctor.frontends.dispatch",
    "check_file": "mixprec.doctor.frontends.dispatch",
    "detect_format": "mixprec.doctor.frontends.dispatch",
    "front_end": "mixprec.doctor.frontends.dispatch",
    "load_config": "mixprec.doctor.frontends.dispatch",
    "ConfigDoc": "mixprec.doctor.frontends.document",
    "read_config": "mixprec.doctor.frontends.document",
    "DeviceArg": "mixprec.doctor.frontends.frontend",
    "FactsReader": "mixprec.doctor.frontends.frontend",
    "FrontEnd": "mixprec.doctor.frontends.frontend",
    "resolve_device": "mixprec.doctor.frontends.frontend",
    "check": "mixprec.doctor.frontends.live",
    "facts_from_objects": "mixprec.doctor.frontends.live",
    "optimizer_facts": "mixprec.doctor.frontends.live",
}

__all__ = [
    "FORMATS",
    "FRONT_ENDS",
    "ConfigDoc",
    "ConfigFormat",
    "DeviceArg",
    "FactsReader",
    "FrontEnd",
    "check",
    "check_config",
    "check_file",
    "detect_format",
    "facts_from_objects",
    "front_end",
    "load_config",
    "optimizer_facts",
    "read_config",
    "resolve_device",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mixprec.doctor.frontends' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
