"""What a storage format declares about itself: its state tensors and what it needs.

A master format (how the full-precision value of a 16-bit parameter is kept)
and a moment format (how AdamW's two moments are stored) each declare one
spec. The optimizer, the memory model, the doctor, the policy checks and the
native kernel read these specs instead of keeping tables of their own, so a
fact such as "``remainder8`` costs one byte per element" lives in one place.

Specs are plain data: dtypes are named (``"bf16"``, ``"int8"``), not `torch.dtype`
values, so each format module declares its spec at import without loading torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from mixprec.floats import canonical_name, itemsize, torch_name

__all__ = ["ADAM_MOMENTS", "RESERVED_STATE_KEYS", "MasterSpec", "MomentSpec", "StateTensor"]


@dataclass(frozen=True)
class StateTensor:
    """One per-parameter state tensor of a format.

    Attributes:
        name: the optimizer-state key it is stored under.
        dtype: its storage dtype, by name: a floating format's canonical name
            (``"fp32"``, ``"bf16"``) or torch's name of an integer dtype (``"int8"``);
            a `torch.dtype` given here is stored as its name.
        per_block: True for one value per quantization block of elements (int8
            scales), False for one value per parameter element.
        follows_param: True when the tensor is stored in the parameter's own
            dtype (Kahan compensation); `dtype` then names one such dtype, of
            the same size as every dtype the format accepts.
        per_row: True for one value per row of the parameter viewed as a matrix
            ``(shape[0], numel // shape[0])`` (int4's rank-1 row statistics).
        per_column: True for one value per column of that matrix view.
        packed: True for two 4-bit codes per stored byte, packed along the rows
            of that matrix view (shape ``(shape[0], numel // shape[0] // 2)``).
    """

    name: str
    dtype: str
    per_block: bool = False
    follows_param: bool = False
    per_row: bool = False
    per_column: bool = False
    packed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _storage_name(self.dtype))

    @property
    def per_element(self) -> bool:
        """True when the tensor holds one value per element, laid out like the parameter."""
        return not (self.per_block or self.per_row or self.per_column or self.packed)

    @property
    def itemsize(self) -> int:
        """Bytes of one stored value."""
        return itemsize(self.dtype)

    @property
    def torch_dtype(self) -> Any:
        """The `torch.dtype` it is stored in (imports torch)."""
        import torch  # specs are plain data; tensors need torch

        return getattr(torch, torch_name(self.dtype))


#: State keys the optimizer itself uses; no format may store under them.
RESERVED_STATE_KEYS = frozenset({"step", "rng_seed"})

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _check_spec(name: object, state: object, code: object) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == "auto":
        raise ValueError(
            f"format name {name!r} must be a lowercase identifier (letters, digits, _) "
            "other than 'auto'"
        )
    if not isinstance(state, tuple) or not all(isinstance(t, StateTensor) for t in state):
        raise TypeError(f"format {name!r}: state must be a tuple of StateTensor, got {state!r}")
    keys = [t.name for t in state]
    if len(set(keys)) != len(keys):
        raise ValueError(f"format {name!r}: state keys {keys} repeat")
    for t in state:
        if not isinstance(t.name, str) or not t.name or t.name in RESERVED_STATE_KEYS:
            raise ValueError(
                f"format {name!r}: state key {t.name!r} is empty or reserved "
                f"({', '.join(sorted(RESERVED_STATE_KEYS))})"
            )
        try:
            itemsize(t.dtype)
        except (TypeError, ValueError, KeyError):
            raise TypeError(
                f"format {name!r}: state {t.name!r} dtype must name a storage dtype "
                f"('fp32', 'bf16', 'int8', ...), got {t.dtype!r}"
            ) from None
    if code is not None and (isinstance(code, bool) or not isinstance(code, int) or code < 0):
        raise ValueError(f"format {name!r}: kernel_code must be an int >= 0, got {code!r}")


def _check_flags(name: str, **flags: object) -> None:
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"format {name!r}: {key} must be True or False, got {value!r}")


def _floating(dtype: object) -> str | None:
    """The canonical name of a floating dtype or spelling; None for anything else."""
    try:
        return canonical_name(dtype)
    except (TypeError, ValueError):
        return None


def _storage_name(dtype: object) -> object:
    """A storage dtype's name: the canonical name of a floating one, torch's name of an
    integer one; anything else is returned as is (and refused by the spec's checks)."""
    floating = _floating(dtype)
    if floating is not None:
        return floating
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        return str(dtype).removeprefix("torch.")
    return dtype


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _state_nbytes(
    state: tuple[StateTensor, ...], numel: int, block_size: int, rows: int | None = None
) -> int:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    blocks = _ceil_div(numel, block_size)
    rows = max(1, math.isqrt(numel)) if rows is None else max(1, rows)
    counts = {"block": blocks, "row": rows, "column": _ceil_div(numel, rows)}

    def count(t: StateTensor) -> int:
        if t.per_block:
            return counts["block"]
        if t.per_row:
            return counts["row"]
        if t.per_column:
            return counts["column"]
        return _ceil_div(numel, 2) if t.packed else numel

    return sum(t.itemsize * count(t) for t in state)


@dataclass(frozen=True, kw_only=True)
class MasterSpec:
    """A master-weight format: how full precision is kept for a parameter.

    Attributes:
        name: the name policies and the optimizer use (``exact``).
        summary: one line for tables and errors.
        state: the per-parameter state tensors, in encode/decode order.
        param_dtypes: the parameter dtypes the format works with, by canonical
            name (``("bf16",)``; `torch.dtype` values are stored as names), or None
            for any floating dtype (``none``: the parameter is its own master).
        exact: True when decoding gives the fp32 master bit for bit.
        keeps_small_updates: True when updates below half an ulp of the 16-bit
            parameter still accumulate (exactly, to 24 bits, compensated or in
            expectation); False when they are rounded away.
        uses_noise: True when encoding needs random 16-bit integers.
        kernel_code: the format's case in the native kernel's ``enum Master``
            (the build defines ``MIXPREC_MASTER_<NAME>`` to it), or None when the
            native kernel does not implement the format.
    """

    name: str
    summary: str
    state: tuple[StateTensor, ...]
    param_dtypes: tuple[str, ...] | None
    exact: bool
    keeps_small_updates: bool
    uses_noise: bool = False
    kernel_code: int | None = None

    def __post_init__(self) -> None:
        _check_spec(self.name, self.state, self.kernel_code)
        _check_flags(
            self.name,
            exact=self.exact,
            keeps_small_updates=self.keeps_small_updates,
            uses_noise=self.uses_noise,
        )
        dtypes = self.param_dtypes
        if isinstance(dtypes, tuple) and all(_floating(d) for d in dtypes):
            dtypes = tuple(_floating(d) or "" for d in dtypes)
            object.__setattr__(self, "param_dtypes", dtypes)
        if dtypes is not None and not (
            isinstance(dtypes, tuple)
            and dtypes
            and all(isinstance(d, str) and _floating(d) == d for d in dtypes)
        ):
            raise TypeError(
                f"format {self.name!r}: param_dtypes must be None or a tuple of canonical "
                f"floating dtype names ('bf16', 'fp16'), got {dtypes!r}"
            )

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The optimizer-state keys, in encode/decode order."""
        return tuple(t.name for t in self.state)

    @property
    def bytes_per_element(self) -> int:
        """State bytes per parameter element (the parameter itself not counted)."""
        return _state_nbytes(self.state, 1, 1)

    def nbytes(self, numel: int) -> int:
        """State bytes for a parameter of `numel` elements."""
        return _state_nbytes(self.state, numel, 1)

    def accepts(self, dtype: object) -> bool:
        """Whether parameters stored in `dtype` (a `torch.dtype` or a name) can use this
        format."""
        name = _floating(dtype)
        if self.param_dtypes is None:
            return name is not None
        return name in self.param_dtypes

    def check_param_dtype(self, dtype: object) -> None:
        """Raise `ValueError` naming the format, the dtype and the dtypes it needs."""
        if self.accepts(dtype):
            return
        if self.param_dtypes is None:
            raise ValueError(f"master={self.name!r} needs floating params, got {dtype}")
        got = _floating(dtype) or str(dtype).removeprefix("torch.")
        hint = ""
        if got == "fp32":
            hint = " (fp32 params are their own master: use master='none' or 'auto')"
        raise ValueError(
            f"master={self.name!r} needs {', '.join(self.param_dtypes)} params, got {got}{hint}"
        )


#: AdamW's moments, ``(state key, kind)``: what a moment format shows and costs by
#: default (`MomentSpec.state`). Other update rules keep other slots
#: (`mixprec.optim.rules`): SGD's ``momentum_buffer``, AMSGrad's ``max_exp_avg_sq``.
ADAM_MOMENTS: tuple[tuple[str, str], ...] = (("exp_avg", "signed"), ("exp_avg_sq", "square"))


@dataclass(frozen=True, kw_only=True)
class MomentSpec:
    """A moment format: how an optimizer's moments (AdamW's ``exp_avg`` and
    ``exp_avg_sq``, SGD's ``momentum_buffer``, ...) are stored.

    Attributes:
        name: the name policies and the optimizer use (``int8``).
        summary: one line for tables and errors.
        signed: the state tensors of one signed moment (a running mean of gradients),
            in encode/decode order; ``{}`` in a name stands for the moment's key
            (``"{}_i8"`` stores ``exp_avg`` as ``exp_avg_i8``).
        square: the same for one moment of squares (never negative).
        rounds_increments: True when each moment is rounded elementwise to a
            16-bit float, so moving-average increments below half an ulp are
            lost (with ``beta2 = 0.999`` the second moment cannot decay).
        blockwise: True when the format quantizes blocks of elements, which the
            optimizer applies only to tensors whose size is a whole number of
            blocks (others keep fp32 moments).
        block_size: the block size the format always uses (int4: 128), or None
            when it takes the optimizer's ``block_size`` (int8).
        kernel_code: the format's case in the native kernel's ``enum Moments``
            (the build defines ``MIXPREC_MOMENTS_<NAME>`` to it), or None when the
            native kernel does not implement the format.
    """

    name: str
    summary: str
    signed: tuple[StateTensor, ...]
    square: tuple[StateTensor, ...]
    rounds_increments: bool
    blockwise: bool = False
    block_size: int | None = None
    kernel_code: int | None = None

    def __post_init__(self) -> None:
        _check_spec(self.name, self.state, self.kernel_code)
        _check_flags(self.name, rounds_increments=self.rounds_increments, blockwise=self.blockwise)
        if not self.signed or not self.square:
            raise ValueError(f"moment format {self.name!r} must store both kinds of moment")

    def state_for(self, slots: tuple[tuple[str, str], ...]) -> tuple[StateTensor, ...]:
        """The state tensors of the moments `slots` (``(key, kind)`` pairs), in order."""
        return tuple(
            replace(t, name=t.name.format(key))
            for key, kind in slots
            for t in (self.signed if kind == "signed" else self.square)
        )

    @property
    def state(self) -> tuple[StateTensor, ...]:
        """AdamW's moments' state tensors (`ADAM_MOMENTS`), in encode/decode order."""
        return self.state_for(ADAM_MOMENTS)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """AdamW's moments' optimizer-state keys, in encode/decode order."""
        return tuple(t.name for t in self.state)

    def nbytes(
        self,
        numel: int,
        *,
        block_size: int = 1,
        slots: tuple[tuple[str, str], ...] = ADAM_MOMENTS,
        rows: int | None = None,
    ) -> int:
        """State bytes of the moments `slots` for a parameter of `numel` elements
        (per-block scales rounded up; a fixed `MomentSpec.block_size` wins over
        `block_size`). Per-row and per-column statistics count `rows` rows of
        ``numel / rows`` columns; without `rows`, a square matrix is assumed."""
        size = (self.block_size or block_size) if self.blockwise else 1
        return _state_nbytes(self.state_for(slots), numel, size, rows)
