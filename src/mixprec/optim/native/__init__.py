"""The native CPU step of every update rule: `step_cpu.cpp`, built with the system C++
compiler at first use.

Why it exists: on CPU, Inductor's code for the mixed formats is limited by
computation, not memory (16-lane loops, int8 blocks read in two passes; see
docs/benchmarks.md). This kernel is plain C++ that GCC or Clang vectorizes
for the machine it runs on: one pass over memory per step (int8 blocks are
decoded, updated and re-encoded in L1), every storage format inlined, and
OpenMP threads. It mirrors the eager formulation operation for operation, so
its results are bitwise those of ``fused=False``; the tests check every family.

Build: ``$CXX`` (else ``g++``, ``c++`` or ``clang++``) with ``-O3
-march=native -fopenmp`` and IEEE-preserving flags (no fast-math, no FMA
contraction), falling back to fewer flags where the compiler refuses some.
The rule and format codes come from their registries as ``-D`` defines
(`build.format_defines`),
and each master's per-element codec from ``formats/masters/<name>.h``. The shared
library is cached under `cache_dir` keyed by the source and those headers, the
compiler, the flags (codes included) and the CPU, so a machine builds it once
(about 6 s of compiler time).
Setting ``MIXPREC_NATIVE=0`` turns the kernel off (steps then use
`torch.compile`, as on other devices).

Scope: CPU tensors, fp32 or bf16 params and grads (fp16 goes to Inductor),
int8 blocks of at most `MAX_BLOCK` elements, int4 moments (two passes over rows:
docs/formats.md).

Modules: `binding` (the loaded library, its table and checks: `NativeLibrary`,
`NativeTable`) and `build` (compiling and caching it: `library`).
"""

from mixprec.optim.native.binding import (
    ABI_VERSION,
    DTYPES,
    MAX_BLOCK,
    PLAIN_TYPES,
    SOURCE,
    STREAM_MIN_BYTES,
    TABLE_COLUMNS,
    BuildInfo,
    NativeLibrary,
    NativeTable,
    NativeUnavailableError,
    streams_params,
)
from mixprec.optim.native.build import FLAG_SETS, cache_dir, enabled, library

__all__ = [
    "ABI_VERSION",
    "DTYPES",
    "FLAG_SETS",
    "MAX_BLOCK",
    "PLAIN_TYPES",
    "SOURCE",
    "STREAM_MIN_BYTES",
    "TABLE_COLUMNS",
    "BuildInfo",
    "NativeLibrary",
    "NativeTable",
    "NativeUnavailableError",
    "cache_dir",
    "enabled",
    "library",
    "streams_params",
]
