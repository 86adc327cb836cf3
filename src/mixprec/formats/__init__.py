"""Storage formats of optimizer state: master weights and moments, and their registry.

Each format is one module under `masters/` or `moments/` holding its spec
(plain data: state tensors with dtypes and bytes per element, exactness, the
parameter dtypes it needs, its native kernel code), its encode and decode, and
its registration; it imports torch only inside its tensor code. The registry
(`registry`) holds every format, built-in or registered, and every table
elsewhere (policy checks, memory model, doctor, optimizer-state accounting,
native kernel codes) is derived from it. The names below load on first use
(PEP 562), and ``import mixprec.formats.registry`` costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.formats.masters import MasterFormat
    from mixprec.formats.moments import MomentFormat
    from mixprec.formats.registry import (
        auto_master,
        check_master,
        check_moments,
        master_format,
        master_names,
        master_spec,
        master_specs,
        master_state_keys,
        moment_format,
        moment_names,
        moment_spec,
        moment_specs,
        moment_state_keys,
        register_master,
        register_moments,
        resolve_master,
    )
    from mixprec.formats.spec import MasterSpec, MomentSpec, StateTensor

    #: The registered master formats (the built-in ones first), in table order.
    MASTER_KINDS: tuple[str, ...]
    #: The registered moment formats (the built-in ones first), in table order.
    MOMENT_KINDS: tuple[str, ...]

_REGISTRY = "mixprec.formats.registry"
_EXPORTS: dict[str, str] = {
    "MasterFormat": "mixprec.formats.masters",
    "MomentFormat": "mixprec.formats.moments",
    "MasterSpec": "mixprec.formats.spec",
    "MomentSpec": "mixprec.formats.spec",
    "StateTensor": "mixprec.formats.spec",
    **dict.fromkeys(
        (
            "auto_master",
            "check_master",
            "check_moments",
            "master_format",
            "master_names",
            "master_spec",
            "master_specs",
            "master_state_keys",
            "moment_format",
            "moment_names",
            "moment_spec",
            "moment_specs",
            "moment_state_keys",
            "register_master",
            "register_moments",
            "resolve_master",
        ),
        _REGISTRY,
    ),
}

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "MasterFormat",
    "MasterSpec",
    "MomentFormat",
    "MomentSpec",
    "StateTensor",
    "auto_master",
    "check_master",
    "check_moments",
    "master_format",
    "master_names",
    "master_spec",
    "master_specs",
    "master_state_keys",
    "moment_format",
    "moment_names",
    "moment_spec",
    "moment_specs",
    "moment_state_keys",
    "register_master",
    "register_moments",
    "resolve_master",
]


def __getattr__(name: str) -> Any:
    if name in ("MASTER_KINDS", "MOMENT_KINDS"):
        from mixprec.formats.registry import master_names, moment_names

        return master_names() if name == "MASTER_KINDS" else moment_names()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
