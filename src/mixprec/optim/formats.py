"""Name -> format lookup, and the ``auto`` master rule."""

from __future__ import annotations

import torch

from mixprec.optim.kinds import MasterKind, MomentKind, check_master, check_moments
from mixprec.optim.masters import (
    ExactMaster,
    Fp32Master,
    KahanMaster,
    MasterFormat,
    NoMaster,
    Remainder8Master,
    StochasticMaster,
)
from mixprec.optim.moments import DenseMoments, Int8Moments, MomentFormat

__all__ = ["auto_master", "master_format", "moment_format", "resolve_master"]

_MASTERS: dict[MasterKind, MasterFormat] = {
    "none": NoMaster(),
    "fp32": Fp32Master(),
    "exact": ExactMaster(),
    "remainder8": Remainder8Master(),
    "kahan": KahanMaster(),
    "stochastic": StochasticMaster(),
}


def master_format(kind: str) -> MasterFormat:
    """The master format named `kind` (one of `MASTER_KINDS`)."""
    return _MASTERS[check_master(kind)]


def moment_format(kind: str, *, block_size: int = 256) -> MomentFormat:
    """The moment format named `kind` (one of `MOMENT_KINDS`)."""
    checked: MomentKind = check_moments(kind)
    if checked == "int8":
        return Int8Moments(block_size=block_size)
    if checked == "bf16":
        return DenseMoments(kind="bf16", dtype=torch.bfloat16)
    return DenseMoments(kind="fp32", dtype=torch.float32)


def auto_master(dtype: torch.dtype) -> MasterKind:
    """The ``auto`` rule: ``exact`` for bf16, ``fp32`` for fp16, ``none`` otherwise."""
    if dtype == torch.bfloat16:
        return "exact"
    if dtype == torch.float16:
        return "fp32"
    return "none"


def resolve_master(requested: str, dtype: torch.dtype) -> MasterFormat:
    """The format for a parameter of `dtype` (``auto`` resolved), validated for the dtype."""
    if requested == "auto":
        fmt = _MASTERS[auto_master(dtype)]
    else:
        if requested not in _MASTERS:
            raise ValueError(f"unknown master {requested!r}; valid: auto, {', '.join(_MASTERS)}")
        fmt = _MASTERS[check_master(requested)]
    fmt.check_dtype(dtype)
    return fmt
