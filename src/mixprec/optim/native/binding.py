"""The loaded native kernel: its ctypes binding, the table it reads and the checks
made when a table is built (`NativeLibrary`, `NativeTable`). Building and caching
the shared library is `mixprec.optim.native.build`."""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mixprec.formats import master_spec, moment_spec
from mixprec.optim.rules import RULES, rule

if TYPE_CHECKING:
    from mixprec.optim.kernels import StepFamily
    from mixprec.optim.step_batch import StepBatch

#: The update rules the kernel implements (`mixprec.optim.rules`): every one.
NATIVE_RULES = frozenset(RULES)

#: Largest int8 block the kernel handles (its per-block buffers live on the stack).
MAX_BLOCK = 4096
#: Must equal ``mixprec_abi_version()`` in the source.
ABI_VERSION = 11
#: An AdamW group whose step moves at least this many bytes (`streams_params`) writes
#: the fp32 master's bf16 parameters with streaming stores: twice the 32 MiB L3 of the
#: AMD EPYC measured in docs/benchmarks.md, so the parameters of a model whose step
#: fits in the cache stay there for the next forward pass.
STREAM_MIN_BYTES = 64 * 2**20


SOURCE = Path(__file__).with_name("step_cpu.cpp")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class NativeUnavailableError(RuntimeError):
    """The native kernel cannot be built or loaded here (the message says why)."""


@dataclass(frozen=True)
class BuildInfo:
    """How the loaded library was made."""

    path: Path
    compiler: str
    flags: tuple[str, ...]
    build_seconds: float  # 0.0 when it came from the cache


class NativeLibrary:
    """The loaded kernel; `step_many` runs one step of a rule over a `StepBatch`."""

    def __init__(self, info: BuildInfo) -> None:
        self.info = info
        lib = ctypes.CDLL(str(info.path))
        if lib.mixprec_abi_version() != ABI_VERSION:
            raise NativeUnavailableError(f"{info.path} has ABI {lib.mixprec_abi_version()}")
        fn = lib.mixprec_step_multi
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_int,  # rule (`Rule.code`)
            ctypes.c_int,  # master
            ctypes.c_int,  # moments
            ctypes.c_int,  # maximize
            ctypes.c_int64,  # count
            ctypes.c_void_p,  # table (int64[TABLE_COLUMNS * count], column after column)
            ctypes.c_void_p,  # hyper (double[5], `Rule.read`)
            ctypes.c_int64,  # block
            ctypes.c_int,  # threads
            ctypes.c_int,  # stream (`streams_params`)
        ]
        self._fn = fn
        codec = lib.mixprec_codec
        codec.restype = ctypes.c_int
        codec.argtypes = [
            ctypes.c_int,  # master
            ctypes.c_int,  # parameter dtype
            ctypes.c_int,  # encode (else decode)
            ctypes.c_int64,  # elements
            ctypes.c_void_p,  # parameter
            ctypes.c_void_p,  # master state s0
            ctypes.c_void_p,  # master state s1
            ctypes.c_void_p,  # fp32 values
            ctypes.c_int,  # threads
        ]
        self._codec = codec
        self._lib = lib

    def covers(self, family: StepFamily) -> bool:
        """Whether this library implements `family`: its rule, and formats that both
        have a registered ``kernel_code`` the kernel has a case for (it says so; a
        format registered with a code of its own has none)."""
        if family.rule.name not in NATIVE_RULES:
            return False
        master, moments = family.master.spec.name, family.moments.spec.name
        codes = master_spec(master).kernel_code, moment_spec(moments).kernel_code
        return None not in codes and self._lib.mixprec_covers(family.rule.code, *codes) == 1

    @staticmethod
    def accepts(param: torch.Tensor, grad: torch.Tensor, *, master: str) -> bool:
        """Whether one tensor of a covered family can be stepped here: plain contiguous
        CPU tensors, fp32 or bf16, a parameter dtype the master takes. (int8 block sizes
        are checked per call: `supports`.)"""
        return (
            param.dtype in _DTYPE_CODES
            and grad.dtype in _DTYPE_CODES
            and param.device.type == "cpu"
            and grad.device.type == "cpu"
            and type(param) in _PLAIN
            and type(grad) in _PLAIN
            and param.is_contiguous()
            and grad.is_contiguous()
            and master_spec(master).accepts(param.dtype)
        )

    def supports(
        self, family: StepFamily, *, param: torch.Tensor, grad: torch.Tensor, block_size: int
    ) -> bool:
        """Whether `step_many` handles this parameter (else the caller uses another kernel)."""
        master, moments = family.master.spec.name, family.moments.spec.name
        if not self.covers(family) or not self.accepts(param, grad, master=master):
            return False
        return not moment_spec(moments).blockwise or (
            1 <= block_size <= MAX_BLOCK and param.numel() % block_size == 0
        )

    def codec_accepts(self, param: torch.Tensor, *, master: str) -> bool:
        """Whether `codec` takes `param` with master format `master`: a plain contiguous
        CPU tensor of a dtype the kernel has that master's codec for (bf16; fp32 with
        ``none``), a master with a ``kernel_code`` that draws no rounding noise."""
        spec = master_spec(master)
        code = _DTYPE_CODES.get(param.dtype)
        return (
            code is not None
            and param.device.type == "cpu"
            and type(param) in _PLAIN
            and param.is_contiguous()
            and spec.kernel_code is not None
            and not spec.uses_noise
            and spec.accepts(param.dtype)
            and self._lib.mixprec_codec_covers(spec.kernel_code, code) == 1
        )

    def codec(
        self,
        master: str,
        param: torch.Tensor,
        state: Sequence[torch.Tensor],
        values: torch.Tensor,
        *,
        encode: bool,
    ) -> None:
        """Master format `master`'s decode (`param` and its master `state`, in the
        spec's order, into the fp32 `values`) or encode (`values` into `param` and
        `state`), bitwise the format's own, in one parallel pass.

        Raises:
            ValueError: a tensor is not a plain contiguous CPU tensor, or a dtype or
                size does not fit the master (`codec_accepts`); nothing is read.
        """
        spec = master_spec(master)
        if not self.codec_accepts(param, master=master):
            raise ValueError(
                f"native codec: master {master!r} over a {param.dtype} "
                f"{type(param).__name__} on {param.device} (contiguous: "
                f"{param.is_contiguous()}) is not covered (see codec_accepts)"
            )
        expected = [param.dtype if t.follows_param else t.torch_dtype for t in spec.state]
        tensors = (*state, values)
        if (
            not PLAIN_TYPES.issuperset(map(type, tensors))
            or not all(map(_IS_CPU, tensors))
            or not all(map(torch.Tensor.is_contiguous, tensors))
            or list(map(_DTYPE, tensors)) != [*expected, torch.float32]
            or list(map(torch.Tensor.numel, tensors)) != [param.numel()] * len(tensors)
        ):
            raise ValueError(
                f"native codec: master {master!r} needs contiguous CPU state tensors "
                f"{expected} and fp32 values, each of the parameter's {param.numel()} "
                f"elements; got {[(t.dtype, t.numel(), t.is_contiguous()) for t in tensors]}"
            )
        pointers = [t.data_ptr() for t in state] + [0] * (2 - len(state))
        rc = self._codec(
            spec.kernel_code,
            _DTYPE_CODES[param.dtype],
            int(encode),
            param.numel(),
            param.data_ptr(),
            *pointers,
            values.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"native codec refused master {master!r} (code {rc})")

    def step_many(self, batch: StepBatch, hyper: Sequence[float]) -> None:
        """One step of the batch's rule over `batch` (see `mixprec.optim.kernels.step_`),
        in one call.

        Each parameter's step counter (a float64 0-d tensor) is incremented and its
        per-step scalars computed in the kernel, as `Rule.scalars` computes them; the
        rounding key is made from the seeds and offsets. `hyper` is the rule's
        (`Rule.read`). Every tensor must be contiguous on
        the CPU (`accepts` says which qualify); nothing is written unless every
        parameter is accepted.
        """
        if batch.params:
            self.prepare(batch).run(hyper)

    def prepare(self, batch: StepBatch, *, retain: bool = False) -> NativeTable:
        """`step_many`'s checks and table, without the call: a `NativeTable` that runs
        the step now (``run(hyper)``) or at every step of a gathered batch whose
        gradient pointers are patched in (``retain=True``: it then holds views of the
        parameters and state tensors, so their memory outlives anything done to the
        tensors themselves).

        Raises:
            ValueError: as `step_many` (nothing is written).
        """
        params, grads, steps, seeds = batch.params, batch.grads, batch.steps, batch.seeds
        master_state, moment_state, offsets = batch.master_state, batch.moment_state, batch.offsets
        family, block_size = batch.family, batch.block_size
        master, moments = family.master.spec.name, family.moments.spec.name
        count = len(params)
        if count == 0:
            raise ValueError("native step: no parameters to prepare")
        codes = _family(family.rule.name, master, moments)
        n_master, n_moments = len(codes.master_dtypes), len(codes.moment_dtypes)
        if len(master_state) != count * n_master or len(moment_state) != count * n_moments:
            raise ValueError("native step: state lists do not match the formats")
        if len(grads) != count or len(steps) != count or len(offsets) != count:
            raise ValueError(
                f"native step: {count} parameters need as many gradients, step counters "
                f"and offsets (got {len(grads)}, {len(steps)}, {len(offsets)})"
            )
        if len(seeds) != (count if codes.uses_noise else 0):
            raise ValueError(
                f"native step: master {master!r} needs "
                f"{count if codes.uses_noise else 0} seeds, got {len(seeds)}"
            )
        if (
            not PLAIN_TYPES.issuperset(map(type, steps))
            or list(map(_DTYPE, steps)) != [torch.float64] * count
        ):
            raise ValueError(
                "native step: each state['step'] must be a float64 tensor holding one "
                "value, e.g. torch.tensor(0.0, dtype=torch.float64) (got "
                f"{sorted({type(s).__name__ + ' ' + str(getattr(s, 'dtype', '')) for s in steps})})"
            )
        # Every pointer handed to C must be a contiguous CPU tensor of the right dtype:
        # checked here, with C-level loops (this runs for every tensor on every step).
        everything = (*params, *grads, *master_state, *moment_state, *steps, *seeds)
        if not (all(map(_IS_CPU, everything)) and all(map(torch.Tensor.is_contiguous, everything))):
            raise ValueError("native step needs contiguous CPU tensors")
        if seeds and list(map(_DTYPE, seeds)) != [torch.int64] * count:
            raise ValueError("native step: rounding seeds must be int64")
        if list(map(torch.Tensor.numel, (*steps, *seeds))) != [1] * (count + len(seeds)):
            raise ValueError("native step: step counters and seeds must hold one value each")
        if (
            list(map(_DTYPE, master_state)) != list(codes.master_dtypes) * count
            or list(map(_DTYPE, moment_state)) != list(codes.moment_dtypes) * count
        ):
            raise ValueError(
                f"native step: state dtypes differ from the formats' "
                f"({master!r}: {codes.master_dtypes}, {moments!r}: {codes.moment_dtypes})"
            )
        dtype_code = _DTYPE_CODES.get
        param_codes = [c for c in map(dtype_code, map(_DTYPE, params)) if c is not None]
        grad_codes = [c for c in map(dtype_code, map(_DTYPE, grads)) if c is not None]
        if len(param_codes) != count or len(grad_codes) != count:
            raise ValueError("native step: parameters and gradients must be fp32 or bf16")
        # One int64 table, column after column (see TABLE_COLUMNS and the C source).
        data = torch.Tensor.data_ptr
        absent = [0] * count
        columns = [
            param_codes,
            grad_codes,
            list(map(torch.Tensor.numel, params)),
            list(offsets),
            list(map(data, params)),
            list(map(data, grads)),
            *(
                list(map(data, master_state[k::n_master])) if k < n_master else absent
                for k in (0, 1)
            ),
            *(
                list(map(data, moment_state[k::n_moments])) if k < n_moments else absent
                for k in range(MOMENT_COLUMNS)
            ),
            list(map(data, steps)),
            list(map(data, seeds)) if seeds else absent,
        ]
        # The state's sizes: the kernel checks them against each parameter's before it
        # writes anything (a parameter resized by `p.data = ...` must not be stepped
        # with its old state).
        numel = torch.Tensor.numel
        columns += [
            list(map(numel, master_state[k::n_master])) if k < n_master else absent for k in (0, 1)
        ]
        columns += [
            list(map(numel, moment_state[k::n_moments])) if k < n_moments else absent
            for k in range(MOMENT_COLUMNS)
        ]
        columns.append(list(map(numel, grads)))
        # What the kernel writes (parameters, state, step counters) must not share memory:
        # two parameters' state made one (`state[q]['exp_avg'] = state[p]['exp_avg']`)
        # would be updated from two threads at once.
        col = TABLE_COLUMNS.index
        states = slice(col("s0"), col("step"))
        state_sizes = slice(col("s0_numel"), col("grad_numel"))
        written = [
            pointer
            for pointers, sizes in zip(
                (columns[col("param")], *columns[states], columns[col("step")]),
                (columns[col("numel")], *columns[state_sizes], [1] * count),
                strict=True,
            )
            for pointer, size in zip(pointers, sizes, strict=True)
            if size > 0
        ]
        if len(set(written)) != len(written):
            raise ValueError(
                "native step: two parameters' state tensors (or a state tensor and a "
                "parameter) share memory, e.g. after state[q]['exp_avg'] = "
                "state[p]['exp_avg']: each would be updated from two threads at once; give "
                "each parameter state tensors of its own (.clone())"
            )
        # array.array fills the table in C (a ctypes array from Python ints costs
        # about 90 ns an entry: 2 us a parameter).
        table = array.array("q", itertools.chain.from_iterable(columns))
        stream = (
            codes.streams and sum(columns[col("numel")]) * codes.moved_bytes >= STREAM_MIN_BYTES
        )
        return NativeTable(
            self,
            rule=family.rule.name,
            master=master,
            moments=moments,
            maximize=family.maximize,
            count=count,
            table=table,
            block_size=block_size,
            stream=stream,
            retained=(
                tuple(t.detach() for t in (*params, *master_state, *moment_state, *steps, *seeds))
                if retain
                else ()
            ),
        )


class NativeTable:
    """A checked kernel table for fixed parameters and state (`NativeLibrary.prepare`).

    `run` steps them. A gathered batch (`mixprec.optim.group_step`) keeps one and,
    each step, writes its gradients' pointers into `grads` (0: no gradient, the row
    is skipped) and their dtype codes into `grad_dtypes`, then calls `fn` with
    `args` (the hyperparameters and thread count in between: see `call`).
    """

    def __init__(
        self,
        library: NativeLibrary,
        *,
        rule: str,
        master: str,
        moments: str,
        maximize: bool,
        count: int,
        table: array.array[int],
        block_size: int,
        stream: bool,
        retained: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._retained = retained
        self.names = (rule, master, moments, block_size)
        codes = _family(rule, master, moments)
        self.count = count
        self.table = table
        start = TABLE_COLUMNS.index("grad") * count
        #: The table's gradient pointer column, and its gradient dtype column.
        self.grads = slice(start, start + count)
        start = TABLE_COLUMNS.index("grad_dtype") * count
        self.grad_dtypes = slice(start, start + count)
        #: The C function and its arguments before and after ``hyper``, ``threads``.
        self.fn = library._fn
        self.head = (codes.rule_code, codes.master_code, codes.moments_code, int(maximize), count)
        self.address = table.buffer_info()[0]
        self.block_size = block_size
        self.stream = int(stream)

    def run(self, hyper: Sequence[float]) -> None:
        """One step; `hyper` is the rule's (`Rule.read`).

        Raises:
            ValueError: the kernel refused the table (nothing was written).
        """
        rc = self.fn(
            *self.head,
            self.address,
            HYPER(*hyper),
            self.block_size,
            torch.get_num_threads(),
            self.stream,
        )
        if rc != 0:
            raise self.refused(rc)

    def refused(self, rc: int) -> ValueError:
        """The error for the kernel's return code `rc` (nothing was written)."""
        name, master, moments, block = self.names
        hyper_names = [h for h in rule(name).hyper_names if h != "-"]
        why = {
            1: "a dtype combination it does not build",
            2: "a bad block size",
            3: "a gradient or state tensor whose size does not match its parameter "
            "(was the parameter resized, e.g. by `p.data = ...`, after its state was made, "
            "or a state tensor emptied in place, e.g. by `set_()`?)",
            4: "a step counter that is not a whole number >= 0 (state['step'])",
            5: f"a hyperparameter out of range for {name} (its {', '.join(hyper_names)}: "
            "finite values within the bounds its constructor checks; nothing was stepped)",
        }
        return ValueError(
            f"native step refused rule={name!r} master={master!r} moments={moments!r} "
            f"block {block} (code {rc}): {why.get(rc, 'unknown')}"
        )


#: The kernel's ``hyper`` argument type: the five values of `Rule.read`.
HYPER = ctypes.c_double * 5

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Tensor types whose data the kernel may read through a pointer (not subclasses).
PLAIN_TYPES = frozenset(_PLAIN)
#: Parameter and gradient dtypes the kernel is built for.
DTYPES = frozenset(_DTYPE_CODES)
_IS_CPU = operator.attrgetter("is_cpu")
_DTYPE = operator.attrgetter("dtype")


#: Columns of the int64 table `step_many` hands the kernel (one row per parameter).
TABLE_COLUMNS = (
    "param_dtype",
    "grad_dtype",
    "numel",
    "offset",
    "param",
    "grad",
    "s0",
    "s1",
    "mo0",
    "mo1",
    "mo2",
    "mo3",
    "mo4",
    "mo5",
    "mo6",
    "mo7",
    "step",
    "seed",
    "s0_numel",
    "s1_numel",
    "mo0_numel",
    "mo1_numel",
    "mo2_numel",
    "mo3_numel",
    "mo4_numel",
    "mo5_numel",
    "mo6_numel",
    "mo7_numel",
    "grad_numel",
)
#: Moment pointer columns: up to three slots (AMSGrad): int8 codes and scale each, int4
#: codes and absmax for the signed slot, codes, row and column maxima for each square one.
MOMENT_COLUMNS = 8


@dataclass(frozen=True)
class _FamilyCodes:
    rule_code: int
    master_code: int
    moments_code: int
    master_dtypes: tuple[torch.dtype, ...]
    moment_dtypes: tuple[torch.dtype, ...]
    uses_noise: bool
    streams: bool  # the kernel can stream this family's parameter stores
    moved_bytes: int  # bytes one step moves per element, counting bf16 params and grads


@functools.cache
def _family(rule_name: str, master: str, moments: str) -> _FamilyCodes:
    step_rule, mspec, mospec = rule(rule_name), master_spec(master), moment_spec(moments)
    return _FamilyCodes(
        step_rule.code,
        _kernel_code(mspec.kernel_code, master),
        _kernel_code(mospec.kernel_code, moments),
        tuple(t.torch_dtype for t in mspec.state),
        tuple(t.torch_dtype for t in mospec.state_for(step_rule.slots)),
        mspec.uses_noise,
        # AdamW's fp32 master writes the parameter without reading it (the others
        # decode it); the int8 moments' block loops and the other rules' staged
        # loops do not stream.
        step_rule.name == "adamw" and mspec.name == "fp32" and not mospec.blockwise,
        2 + 2 + mspec.bytes_per_element + mospec.nbytes(1, slots=step_rule.slots),
    )


def streams_params(*, master: str, moments: str, numel: int, rule: str = "adamw") -> bool:
    """Whether `NativeLibrary.step_many` writes the parameters of a group of `numel`
    elements in all with streaming (non-temporal) stores.

    Only AdamW's loop for the ``fp32`` master with dense moments streams (`rule`:
    the other rules' staged loops do not): it writes its bf16 parameter without
    reading it; a plain store of such a line first reads it (a read for
    ownership: 2 bytes per element that nothing uses, 30 bytes moved per element
    instead of 28 with fp32 moments). Streaming stores skip that read but leave
    the lines out of the cache, so they are used only when the step moves at
    least `STREAM_MIN_BYTES` (``numel`` times the bytes per element of the
    formats, the parameter and a bf16 gradient), far more than the cache holds.

    Raises:
        ValueError: `master` or `moments` is not a registered format.
        KeyError: `rule` is not an update rule.
    """
    codes = _family(rule, master, moments)
    return codes.streams and numel * codes.moved_bytes >= STREAM_MIN_BYTES


def _kernel_code(code: int | None, name: str) -> int:
    if code is None:
        raise ValueError(f"format {name!r} has no native kernel code (check `supports` first)")
    return code
