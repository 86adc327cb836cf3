"""The vocabulary of optimizer storage formats: master representations and moment formats.

Shared by `mixprec.policy` (which names them) and `mixprec.optim` (which
implements them), so both agree on one spelling.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "MasterKind",
    "MomentKind",
    "check_master",
    "check_moments",
]

MasterKind = Literal["none", "fp32", "exact", "remainder8", "kahan", "stochastic"]
MomentKind = Literal["fp32", "bf16", "int8"]

#: How full precision is kept for 16-bit parameters.
#: none: the 16-bit params are updated directly; fp32: a separate fp32 copy;
#: exact: bf16 + int16 remainder, bitwise fp32; remainder8: bf16 + int8 correction
#: (24-bit master); kahan: bf16 + bf16 compensation; stochastic: stochastic rounding.
MASTER_KINDS: tuple[MasterKind, ...] = (
    "none",
    "fp32",
    "exact",
    "remainder8",
    "kahan",
    "stochastic",
)

#: Storage of the AdamW moments (int8 is blockwise quantized with a per-block scale).
MOMENT_KINDS: tuple[MomentKind, ...] = ("fp32", "bf16", "int8")


def check_master(value: str) -> MasterKind:
    """Validate a master representation name, raising `ValueError` listing valid ones."""
    if value not in MASTER_KINDS:
        raise ValueError(f"unknown master {value!r}; valid: {', '.join(MASTER_KINDS)}")
    return value


def check_moments(value: str) -> MomentKind:
    """Validate a moment format name, raising `ValueError` listing valid ones."""
    if value not in MOMENT_KINDS:
        raise ValueError(f"unknown moments {value!r}; valid: {', '.join(MOMENT_KINDS)}")
    return value
