"""The doctor's front ends: what turns a setup into `TrainingFacts` for the static rules.

Config files (`dispatch`: format detection and `check_file`; one module per
format: `mixprec_yaml`, `nemo_yaml`) and live objects (`live`: `check`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.doctor.frontends.dispatch import FORMATS as FORMATS
    from mixprec.doctor.frontends.dispatch import FRONT_ENDS as FRONT_ENDS
    from mixprec.doctor.frontends.dispatch import ConfigFormat as ConfigFormat
    from mixprec.doctor.frontends.dispatch import check_config as check_config
    from mixprec.doctor.frontends.dispatch import check_file as check_file
    from mixprec.doctor.frontends.dispatch import detect_format as detect_format
    from mixprec.doctor.frontends.dispatch import front_end as front_end
    from mixprec.doctor.frontends.dispatch import load_config as load_config
    from mixprec.doctor.frontends.document import ConfigDoc as ConfigDoc
    from mixprec.doctor.frontends.document import read_config as read_config
    from mixprec.doctor.frontends.frontend import DeviceArg as DeviceArg
    from mixprec.doctor.frontends.frontend import FactsReader as FactsReader
    from mixprec.doctor.frontends.frontend import FrontEnd as FrontEnd
    from mixprec.doctor.frontends.frontend import resolve_device as resolve_device
    from mixprec.doctor.frontends.live import check as check
    from mixprec.doctor.frontends.live import facts_from_objects as facts_from_objects
    from mixprec.doctor.frontends.live import optimizer_facts as optimizer_facts

#: Public name -> the module that defines it (the imports above are what type checkers
#: read; tests/test_public_api.py keeps both equal). Imported on first use (PEP 562):
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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mixprec.doctor.frontends' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
