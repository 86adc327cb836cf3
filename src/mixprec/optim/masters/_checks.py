"""Shared dtype validation for master formats."""

from __future__ import annotations

import torch

from mixprec.dtypes import dtype_name

__all__ = ["require_dtype"]


def require_dtype(kind: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise `ValueError` naming the master, the dtype and the allowed dtypes."""
    if dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        hint = ""
        if dtype == torch.float32:
            hint = " (fp32 params are their own master: use master='none' or 'auto')"
        raise ValueError(f"master={kind!r} needs {names} params, got {dtype_name(dtype)}{hint}")
