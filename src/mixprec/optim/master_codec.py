"""A master read out and written back: decode to fp32 values, encode into the master.

`Mastered` steps a torch optimizer on fp32 values decoded from each parameter's
master and encodes the results back. Three codecs give the same bits: the native
CPU kernel's (`NativeLibrary.codec`, one parallel pass, the formats' C++ codecs in
`formats/masters/*.h`), each format's pure ``decode``/``encode`` compiled as one
kernel (``codec="compiled"``, for CUDA where the native kernel does not run), and
those functions eagerly (the reference). `backend` says which one a parameter takes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, ParamSpec, TypeVar

import torch

from mixprec.formats import MasterFormat, master_format
from mixprec.optim import native
from mixprec.optim.inductor import COMPILE_OPTIONS, vector_bitcasts

__all__ = ["CODECS", "Codec", "backend", "decode", "encode"]

#: ``Mastered(codec=...)``: ``auto`` (native where it applies, else eager),
#: ``compiled`` or ``eager``.
Codec = Literal["auto", "compiled", "eager"]
CODECS: tuple[str, ...] = ("auto", "compiled", "eager")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def backend(fmt: MasterFormat, param: torch.Tensor, codec: str) -> str:
    """What decodes and encodes `param`'s master under ``codec=``: ``"native"``,
    ``"compiled"`` or ``"eager"``."""
    library = _native_library() if codec == "auto" else None
    if library is not None and library.codec_accepts(param, master=fmt.spec.name):
        return "native"
    return "compiled" if codec == "compiled" else "eager"


def decode(
    fmt: MasterFormat, param: torch.Tensor, state: list[torch.Tensor], out: torch.Tensor, how: str
) -> None:
    """Decode `param`'s master (`state`, in the format's key order) into fp32 `out`,
    with the `backend` `how`."""
    if how == "native":
        library = _native_library()
        assert library is not None
        library.codec(fmt.spec.name, param, state, out, encode=False)
    else:
        _codec(fmt.spec.name, how == "compiled")[0](param, state, out)


def encode(
    fmt: MasterFormat, param: torch.Tensor, state: list[torch.Tensor], value: torch.Tensor, how: str
) -> None:
    """Encode fp32 `value` into `param` and its master `state`, in place, with the
    `backend` `how`."""
    if how == "native":
        library = _native_library()
        assert library is not None
        library.codec(fmt.spec.name, param, state, value.contiguous(), encode=True)
    else:
        _codec(fmt.spec.name, how == "compiled")[1](value, param, state)


DecodeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], None]
EncodeFn = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None]


@functools.cache
def _codec(name: str, compiled: bool) -> tuple[DecodeFn, EncodeFn]:
    """Master format `name`'s decode (into an fp32 tensor) and encode (into the
    parameter and its state, in place), eager or each compiled as one kernel (shapes
    dynamic)."""
    fmt = master_format(name)

    def decode(param: torch.Tensor, state: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(fmt.decode(param, state))

    def encode(value: torch.Tensor, param: torch.Tensor, state: list[torch.Tensor]) -> None:
        stored, kept = fmt.encode(value, dtype=param.dtype, noise=None)
        param.copy_(stored)
        for dst, src in zip(state, kept, strict=True):
            dst.copy_(src)

    if not compiled:
        return decode, encode
    return _compiled(decode), _compiled(encode)


@functools.cache
def _native_library() -> native.NativeLibrary | None:
    """The native kernel, or None where it cannot be built or loaded (``MIXPREC_NATIVE=0``,
    no compiler): masters then take the eager codec (once per process: a failed build
    is not retried)."""
    try:
        return native.library()
    except native.NativeUnavailableError:
        return None


def _compiled(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` compiled with mixprec's Inductor options (`optim.inductor`), shapes dynamic."""
    graph = torch.compile(fn, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with vector_bitcasts():
            return graph(*args, **kwargs)

    return run
