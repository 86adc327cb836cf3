"""The doctor's front ends: what turns a setup into `TrainingFacts` for the static rules.

Config files (`dispatch`: format detection and `check_file`; one module per
format: `mixprec_yaml`, `nemo_yaml`) and live objects (`live`: `check`).
"""

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
