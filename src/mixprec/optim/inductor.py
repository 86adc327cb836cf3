"""How the optimizer step is compiled: Inductor options and one codegen override.

Three things make Inductor's C++ (CPU) output agree with eager and run fast
(torch 2.13; measurements on the project's 2-core AVX-512 machine):

* ``emulate_precision_casts``: without it the CPU backend's common-subexpression
  cache answers ``x.to(bf16).to(fp32)`` with ``x`` itself (the round trip is
  elided, pytorch#115260), so "round to bf16" silently does nothing inside a
  fused kernel. Every master format rounds that way.
* the ``realize_*_threshold`` options: with the defaults, Inductor stores the
  new moments and master value of an int8-moment step in fp32 buffers of the
  parameter's size (fresh pages and two more passes each step); raised, it
  recomputes them where needed, and the step needs no full-size temporary.
* vector bitcasts: Inductor emits ``x.view(torch.int32)`` of an fp32 vector as
  a store, a scalar loop of ``c10::bit_cast`` and a reload (an in-place pass
  over 16M floats with two of them: 33.5 ms instead of 7.7 ms).
  `vector_bitcasts` makes it emit the register reinterpretation
  ``at::vec::cast`` instead (no instruction at all). It only
  changes generated code for fp32 <-> int32 bitcasts, which mean the same
  either way, is active only while a mixprec step runs (and compiles), and is
  skipped when Inductor's internals do not have the expected shape (then the
  step is slower, never different).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import torch

__all__ = ["COMPILE_OPTIONS", "compile_fn", "vector_bitcasts", "vector_bitcasts_supported"]

#: Inductor options of every compiled mixprec step.
COMPILE_OPTIONS: dict[str, Any] = {
    "emulate_precision_casts": True,
    "realize_reads_threshold": 1000,
    "realize_opcount_threshold": 1000,
    "realize_acc_reads_threshold": 1000,
}

_P = ParamSpec("_P")
_R = TypeVar("_R")
_lock = threading.Lock()
_depth = 0
_original: Any = None


def _vec_overrides() -> Any:
    try:
        from torch._inductor.codegen import cpp
    except ImportError:
        return None
    overrides = getattr(cpp, "CppVecOverrides", None)
    method = vars(overrides).get("to_dtype_bitcast") if overrides is not None else None
    return overrides if isinstance(method, staticmethod) else None


def vector_bitcasts_supported() -> bool:
    """Whether this torch's Inductor has the codegen hook `vector_bitcasts` uses."""
    return _vec_overrides() is not None


def _make_override(original: Callable[..., str]) -> Callable[..., str]:
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP
    from torch._inductor.virtualized import V

    pairs = {(torch.float32, torch.int32), (torch.int32, torch.float32)}

    def to_dtype_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> str:
        num_vectors = getattr(V.kernel, "_get_num_vectors", None)
        if (dtype, src_dtype) not in pairs or num_vectors is None:
            return original(x, dtype, src_dtype)
        n = num_vectors(src_dtype)
        dst = DTYPE_TO_CPP[dtype]
        if n == 1:
            return f"at::vec::cast<{dst}>({x})"
        parts = "; ".join(f"r[{i}] = at::vec::cast<{dst}>({x}[{i}])" for i in range(n))
        return f"([&]() {{ at::vec::VectorizedN<{dst}, {n}> r; {parts}; return r; }}())"

    return to_dtype_bitcast


@contextmanager
def vector_bitcasts() -> Iterator[None]:
    """Within the block, Inductor's CPU backend emits fp32 <-> int32 bitcasts as vector casts."""
    global _depth, _original
    overrides = _vec_overrides()
    if overrides is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _original = vars(overrides)["to_dtype_bitcast"]
            override = _make_override(_original.__func__)
            override.__name__ = "to_dtype_bitcast"  # Inductor looks ops up by name
            overrides.to_dtype_bitcast = staticmethod(override)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                overrides.to_dtype_bitcast = _original
                _original = None


def compile_fn(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`torch.compile` `fn` (full graph) with `COMPILE_OPTIONS`, run under `vector_bitcasts`."""
    compiled = torch.compile(fn, fullgraph=True, options=COMPILE_OPTIONS)

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with vector_bitcasts():
            return compiled(*args, **kwargs)

    return run
