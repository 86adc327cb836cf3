"""One call of the step: the batch it steps (`StepBatch`) and the checked call (`StepKernel`).

`StepBatch` is the one description of a step call: a param group's family as
gathered at the boundaries (`mixprec.optim.group_step`), what
``torch.ops.mixprec.adamw_step_`` steps (`mixprec.optim.ops`) and what the native
kernel's table is built from (`NativeLibrary.prepare`). `StepKernel.run` is the
operator's implementation: the native CPU kernel steps every parameter it accepts
in one call (`mixprec.optim.native`), the others take the portable path, which
concatenates small parameters and steps them with one `adamw_step_` call
(compiled or eager, `mixprec.optim.kernels`). Kernels are process-wide, one per
family and mode (`step_kernel`), so compiled graphs and the native library are
shared by every optimizer.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.formats import StateTensor, master_format, moment_format
from mixprec.optim import native, sharding
from mixprec.optim.kernels import (
    KernelMode,
    StepFamily,
    StepFn,
    compiled_family_function,
    family_function,
    step_,
    warn_native_unavailable,
)
from mixprec.optim.rng import step_key
from mixprec.optim.rules import Hyper, rule

__all__ = [
    "CONCAT_MAX_NUMEL",
    "Hyper",
    "StepBatch",
    "StepKernel",
    "clear_kernels",
    "family_of",
    "kernel_for",
    "step_kernel",
]


@dataclass(eq=False)
class StepBatch:
    """The parameters of one family, group and device that one call steps.

    ``kernel`` is the family and how it runs (its mode); ``block_size`` the
    optimizer's int8 block size. Every tensor is local and as the kernel takes it
    (contiguous: flat views of channels-last parameters). ``master_state`` and
    ``moment_state`` hold each parameter's state tensors in its formats' key order,
    parameter after parameter; ``steps`` the float64 step counters; ``seeds`` is
    empty unless the master draws noise; ``offsets`` are the global flat offsets
    of shards; ``column_groups`` (empty when none is) the process group each
    parameter's column statistics are reduced over, where it is sharded by rows
    under moments that keep them (int4; None for the others).

    A batch gathered for a param group (`mixprec.optim.group_step`) also keeps
    the group's ``index`` (for messages), the parameters themselves (``owners``:
    each step reads their ``.grad``; ``grads`` then holds stand-ins of their size,
    ``params`` again) and, where the native kernel takes every row, its ``table``
    with the gradient dtypes and sizes it was last given.
    """

    kernel: StepKernel
    block_size: int
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    master_state: list[torch.Tensor] = field(default_factory=list)
    moment_state: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    seeds: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    column_groups: list[Any] = field(default_factory=list)
    index: int = 0
    owners: list[torch.Tensor] = field(default_factory=list)
    table: native.NativeTable | None = None
    grad_dtypes: list[torch.dtype] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)

    @property
    def family(self) -> StepFamily:
        """The formats and flags (the kernel's)."""
        return self.kernel.family

    def select(self, rows: Sequence[int], grads: list[torch.Tensor] | None = None) -> StepBatch:
        """The parameters `rows` with their state, as a batch of their own (`grads`:
        their gradients, else the batch's)."""
        nm, nmo = self.kernel.n_master, self.kernel.n_moments
        return StepBatch(
            self.kernel,
            self.block_size,
            params=[self.params[i] for i in rows],
            grads=[self.grads[i] for i in rows] if grads is None else grads,
            master_state=[t for i in rows for t in self.master_state[i * nm : (i + 1) * nm]],
            moment_state=[t for i in rows for t in self.moment_state[i * nmo : (i + 1) * nmo]],
            steps=[self.steps[i] for i in rows],
            seeds=[self.seeds[i] for i in rows] if self.seeds else [],
            offsets=[self.offsets[i] for i in rows],
            column_groups=[self.column_groups[i] for i in rows] if self.column_groups else [],
            index=self.index,
        )


#: Parameters of at most this many elements are concatenated and stepped by one
#: call on the portable (compiled or eager) path; larger ones are stepped one by
#: one (each is large enough to keep a kernel busy).
CONCAT_MAX_NUMEL = 1 << 16


class StepKernel:
    """The step for one family: native, compiled or eager, over a batch of parameters.

    One per family and mode for the whole process (`step_kernel`), shared by every
    optimizer, so compiled graphs and the native library are reused.

    Args:
        family: the formats.
        mode: from `resolve_mode`: ``"native"`` / ``"native-auto"`` /
            ``"native-eager"`` (the native kernel; parameters it does not cover,
            or every parameter if it cannot be built, go to ``"compiled"`` /
            ``"auto"`` / ``"eager"``), ``"compiled"``
            (raise if compilation fails), ``"auto"`` (compile; on failure warn
            once and run eagerly) or ``"eager"``.
    """

    def __init__(self, family: StepFamily, *, mode: KernelMode) -> None:
        self.family = family
        self.requested: KernelMode = mode
        self._native: native.NativeLibrary | None = None
        if mode in ("native", "native-auto", "native-eager"):
            try:
                library = native.library()
                if library.covers(family):
                    self._native = library
            except native.NativeUnavailableError as exc:
                warn_native_unavailable(str(exc))
            fallback: dict[str, KernelMode] = {
                "native": "compiled",
                "native-auto": "auto",
                "native-eager": "eager",
            }
            mode = fallback[mode]
        self.mode: KernelMode = mode
        self._eager = family_function(family)
        self._compiled: StepFn | None = (
            None if mode == "eager" else compiled_family_function(family)
        )
        self._block_size = int(getattr(family.moments, "block_size", 1))
        spec = family.master.spec
        self._master_name, self._moments_name = spec.name, family.moments.spec.name
        #: State tensors per parameter (`StepBatch` lists them parameter after parameter).
        self.n_master = len(spec.state)
        self.n_moments = len(family.moment_tensors)
        self._layouts = family.moment_tensors
        # Packed codes are matrices of each parameter's own width, and rank-1 statistics
        # span a whole parameter: such parameters are never concatenated.
        self._concat = all(t.per_element or t.per_block for t in family.moment_tensors)
        # (key, dtype, follows the parameter's dtype) and (key, dtype, layout) per slot
        self._master = tuple((t.name, t.torch_dtype, t.follows_param) for t in spec.state)
        self._moments = tuple((t.name, t.torch_dtype, t) for t in family.moment_tensors)
        self._master_follows_param = any(t.follows_param for t in spec.state)
        # Parameter dtypes the native kernel steps for this master.
        self._native_dtypes = frozenset(d for d in native.DTYPES if family.master.spec.accepts(d))

    @property
    def native(self) -> native.NativeLibrary | None:
        """The native library where it steps this family, else None."""
        return self._native

    @property
    def is_native(self) -> bool:
        """Whether steps run through the native CPU kernel (where it applies)."""
        return self._native is not None

    @property
    def is_compiled(self) -> bool:
        """Whether steps run fused: the native kernel or the compiled function."""
        return self._native is not None or self._compiled is not None

    def backend(self, dtype: torch.dtype) -> str:
        """What steps a parameter of `dtype` here: ``native`` where the kernel covers the
        dtype, else the portable path's ``compiled`` or ``eager``."""
        if self._native is not None and dtype in self._native_dtypes:
            return "native"
        return "compiled" if self._compiled is not None else "eager"

    def run(self, batch: StepBatch, hyper: Hyper) -> None:
        """One step of every parameter of `batch`: the native kernel for those it
        accepts, in one call; the others on the portable path (`run_portable`).
        Parameters whose column statistics are reduced across ranks step eagerly."""
        if any(batch.column_groups):
            sharded = [i for i, g in enumerate(batch.column_groups) if g is not None]
            others = [i for i, g in enumerate(batch.column_groups) if g is None]
            if others:
                self.run(batch.select(others), hyper)
            self.run_portable(batch.select(sharded), hyper)
            return
        rest: Sequence[int] = range(len(batch.params))
        if self._native is not None:
            ok = self.native_indices(batch)
            if ok:
                native_batch = batch if len(ok) == len(rest) else batch.select(ok)
                try:
                    self._native.step_many(native_batch, hyper)
                except ValueError as exc:  # (nothing was written) name the tensor that misfits
                    misfit = self.misfit(native_batch)
                    if misfit is None:
                        raise
                    raise ValueError(f"nothing was stepped: {misfit}") from exc
                if len(ok) == len(rest):
                    return
                taken = set(ok)
                rest = [i for i in rest if i not in taken]
        whole = len(rest) == len(batch.params)
        self.run_portable(batch if whole else batch.select(rest), hyper)

    def native_indices(self, batch: StepBatch) -> Sequence[int]:
        """Which parameters of `batch` the native kernel takes (usually all: checked at
        once, with C-level loops, before the per-parameter rule)."""
        assert self._native is not None
        # The batch is the normal case; `step_many` checks every tensor it is handed
        # (device, contiguity, dtypes) and raises rather than read a bad pointer.
        if (
            batch.params[0].is_cpu
            and self._native_dtypes.issuperset(map(_DTYPE, batch.params))
            and native.DTYPES.issuperset(map(_DTYPE, batch.grads))
            and native.PLAIN_TYPES.issuperset(map(type, batch.params))
            and native.PLAIN_TYPES.issuperset(map(type, batch.grads))
            and (not self.family.moments.spec.blockwise or self._whole_blocks(batch.params))
        ):
            return range(len(batch.params))
        supports = functools.partial(
            self._native.supports, self.family, block_size=self._block_size
        )
        return [
            i
            for i, (p, g) in enumerate(zip(batch.params, batch.grads, strict=True))
            if supports(param=p, grad=g)
        ]

    def _whole_blocks(self, params: Sequence[torch.Tensor]) -> bool:
        size = self._block_size
        return size <= native.MAX_BLOCK and all(p.numel() % size == 0 for p in params)

    def run_portable(self, batch: StepBatch, hyper: Hyper) -> None:
        """The step with PyTorch operations (compiled or eager): step counters are
        incremented together and read with one host transfer; parameters of at most
        `CONCAT_MAX_NUMEL` elements sharing a step count and dtypes are concatenated
        and stepped by one call, larger ones one by one."""
        n = len(batch.params)
        if n == 0:
            return
        misfit = self.misfit(batch)  # before the counters move: a refusal changes nothing
        if misfit is not None:
            raise ValueError(f"nothing was stepped: {misfit}")
        # Everything that can fail is done before the counters move (a non-contiguous
        # state tensor, a step counter of another shape, a seed of another type): a
        # refusal leaves the batch as it was.
        views = [self._views(batch, i) for i in range(n)]
        if n > 1:
            steps_after = torch.stack(batch.steps) + 1.0
            host_steps = [int(s) for s in steps_after.tolist()]
        else:
            steps_after = None
            host_steps = [int(batch.steps[0].item()) + 1]
        keys: list[torch.Tensor | None] = [None] * n
        if self.family.master.spec.uses_noise:
            seeds = torch.stack(batch.seeds)
            steps = steps_after if steps_after is not None else torch.stack(batch.steps) + 1.0
            offsets = torch.tensor(batch.offsets, dtype=torch.int64, device=seeds.device)
            all_keys = (step_key(seeds, steps) + offsets) & 0xFFFFFFFF
            keys = list(all_keys.unbind(0))
        torch._foreach_add_(batch.steps, 1.0)
        scalars: dict[int, torch.Tensor] = {}
        small: dict[tuple[int, torch.dtype, torch.dtype], list[int]] = {}
        for i, p in enumerate(batch.params):
            step = host_steps[i]
            if step not in scalars:
                scalars[step] = self.family.rule.scalar_tensor(hyper, step, p.device)
            group = batch.column_groups[i] if batch.column_groups else None
            if group is not None:
                self._call(
                    *views[i], scalars[step], keys[i], reduce_columns=sharding.max_over(group)
                )
            elif p.numel() <= CONCAT_MAX_NUMEL and self._concat:
                small.setdefault((step, p.dtype, batch.grads[i].dtype), []).append(i)
            else:
                self._call(*views[i], scalars[step], keys[i])
        for (step, _, _), members in small.items():
            if len(members) == 1:
                i = members[0]
                self._call(*views[i], scalars[step], keys[i])
            else:
                self._concatenated([views[i] for i in members], members, scalars[step], keys)

    def misfit(self, batch: StepBatch) -> str | None:
        """A line naming the first gradient, state tensor or step counter of `batch` that
        does not fit its parameter (its size, dtype or layout; every path refuses it
        before anything moves), else None."""
        numels = list(map(_NUMEL, batch.params))
        state = (*batch.master_state, *batch.moment_state)
        count = len(numels)
        if (
            all(map(isinstance, (*batch.grads, *state, *batch.steps, *batch.seeds), _TENSOR))
            and list(map(_NUMEL, batch.grads)) == numels
            and list(map(_NUMEL, batch.master_state)) == [n for n in numels for _ in self._master]
            and list(map(_NUMEL, batch.moment_state))
            == [self._numel(layout, p) for p in batch.params for _, _, layout in self._moments]
            and list(map(_DTYPE, batch.master_state)) == self._master_dtypes(batch.params)
            and list(map(_DTYPE, batch.moment_state)) == [d for _, d, _ in self._moments] * count
            and all(map(torch.Tensor.is_contiguous, state))
            and list(map(_DTYPE, batch.steps)) == [torch.float64] * count
            and list(map(_NUMEL, batch.steps)) == [1] * count
            and list(map(_DTYPE, batch.seeds)) == [torch.int64] * len(batch.seeds)
            and list(map(_NUMEL, batch.seeds)) == [1] * len(batch.seeds)
        ):
            return None  # the usual case, checked in mostly C-level loops
        nm, nmo = len(self._master), len(self._moments)
        for i, p in enumerate(batch.params):
            n = p.numel()
            slots: list[tuple[str, object, int, torch.dtype | None]] = [
                ("gradient", batch.grads[i], n, None)
            ]
            slots += [
                (f"state[{key!r}]", batch.master_state[i * nm + k], n, p.dtype if follows else d)
                for k, (key, d, follows) in enumerate(self._master)
            ]
            slots += [
                (f"state[{key!r}]", batch.moment_state[i * nmo + k], self._numel(layout, p), d)
                for k, (key, d, layout) in enumerate(self._moments)
            ]
            slots.append(("state['step']", batch.steps[i], 1, torch.float64))
            if batch.seeds:
                slots.append(("state['rng_seed']", batch.seeds[i], 1, torch.int64))
            for what, tensor, expected, dtype in slots:
                found = state_misfit(what, tensor, expected, dtype)
                if found is not None:
                    return f"parameter {tuple(p.shape)}: its {found}"
        return None

    def _numel(self, layout: StateTensor, p: torch.Tensor) -> int:
        """Elements of moment state tensor `layout` for parameter `p`."""
        n = p.numel()
        if layout.per_element:
            return n
        if layout.per_block:
            return n // self._block_size
        if layout.packed:
            return n // 2
        rows, cols = self.family.moments.kernel_shape(p.shape)
        return rows if layout.per_row else cols

    def _master_dtypes(self, params: Sequence[torch.Tensor]) -> list[torch.dtype]:
        """The master state's dtypes for `params`, in batch order."""
        if not self._master_follows_param:
            return [d for _, d, _ in self._master] * len(params)
        return [p.dtype if follows else d for p in params for _, d, follows in self._master]

    def _views(
        self, batch: StepBatch, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Parameter `i`'s tensors viewed as the kernel takes them."""
        # Detached: tracing a Parameter view would also trace its .grad (whose dtype
        # may differ from the parameter's, e.g. fp16 gradients on fp32 parameters).
        p = batch.params[i].detach()
        shape = self.family.moments.kernel_shape(p.shape)
        masters = batch.master_state[i * self.n_master : (i + 1) * self.n_master]
        moments = batch.moment_state[i * self.n_moments : (i + 1) * self.n_moments]
        return (
            p.view(shape),
            batch.grads[i].view(shape),
            [t.view(shape) for t in masters],
            [
                t.view(shape) if layout.per_element else _packed_or_flat(t, layout, shape)
                for t, layout in zip(moments, self._layouts, strict=True)
            ],
        )

    def _concatenated(
        self,
        views: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]],
        members: list[int],
        scalars: torch.Tensor,
        keys: list[torch.Tensor | None],
    ) -> None:
        # Elementwise (and block-local) arithmetic gives the same bits on a
        # concatenation as on each part: step the parts as one tensor, copy back.
        # (`views`: each member's `_views`)
        params = [v[0] for v in views]
        state = [[v[2][k] for v in views] for k in range(self.n_master)] + [
            [v[3][k] for v in views] for k in range(self.n_moments)
        ]
        p_cat = torch.cat(params)
        cat_state = [torch.cat(parts) for parts in state]
        key: torch.Tensor | None = None
        if self.family.master.spec.uses_noise:
            # Element j of member m draws at j + key_m: in the concatenation that is
            # (start_m + j) + (key_m - start_m).
            numels = [p.numel() for p in params]
            starts = torch.tensor(
                [sum(numels[:k]) for k in range(len(numels))], device=p_cat.device
            )
            shift = torch.stack([keys[i] for i in members]) - starts  # type: ignore[misc]
            key = torch.repeat_interleave(
                shift,
                torch.tensor(numels, device=p_cat.device),
                output_size=p_cat.numel(),
            ).view(p_cat.shape)
        self._call(
            p_cat,
            torch.cat([v[1] for v in views]),
            cat_state[: self.n_master],
            cat_state[self.n_master :],
            scalars,
            key,
        )
        rows = [p.shape[0] for p in params]
        dsts = list(params)
        srcs = list(torch.split(p_cat, rows))
        for parts, whole in zip(state, cat_state, strict=True):
            dsts.extend(parts)
            srcs.extend(torch.split(whole, [t.shape[0] for t in parts]))
        torch._foreach_copy_(dsts, srcs)

    def _call(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        master_state: Sequence[torch.Tensor],
        moment_state: Sequence[torch.Tensor],
        scalars: torch.Tensor,
        noise_key: torch.Tensor | None,
        *,
        reduce_columns: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """One `step_` call, compiled or eager (eager with `reduce_columns`)."""
        if noise_key is None:
            noise_key = _unused_key(param.device)
        args = (param, grad, tuple(master_state), tuple(moment_state), scalars, noise_key)
        if reduce_columns is not None:
            step_(*args, family=self.family, reduce_columns=reduce_columns)
            return
        if self._compiled is not None:
            # Dim 0 (elements or blocks) is symbolic from the first compile, so one
            # graph serves every tensor size; the block dim stays static.
            for t in (param, grad, *master_state, *moment_state):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            if noise_key.dim():
                torch._dynamo.maybe_mark_dynamic(noise_key, 0)
            try:
                self._compiled(*args)
                return
            except Exception as exc:
                if self.mode == "compiled":
                    raise
                warnings.warn(
                    f"mixprec optimizers: torch.compile failed for {self.family.name} "
                    f"({type(exc).__name__}: {exc}); running the eager step instead "
                    "(same results, slower). Pass fused=False to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._compiled = None
        self._eager(*args)


_DTYPE = operator.attrgetter("dtype")
_NUMEL = torch.Tensor.numel
_TENSOR = itertools.repeat(torch.Tensor)


def _packed_or_flat(t: torch.Tensor, layout: StateTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Packed codes as rows of the kernel shape (half as wide); statistics flat."""
    if not layout.packed:
        return t.view(-1)
    return t.view(shape[0], t.numel() // shape[0] if shape[0] else t.shape[-1])  # (no rows)


def state_misfit(what: str, tensor: object, numel: int, dtype: torch.dtype | None) -> str | None:
    """How `tensor` (`what`: "gradient", "state['exp_avg']", ...) fails to fit, or None."""
    if not isinstance(tensor, torch.Tensor) and what == "state['step']":
        return (
            f"{what} is a {type(tensor).__name__}, not a tensor: a step counter is a float64 "
            f"tensor of one value, e.g. torch.tensor({tensor!r}, dtype=torch.float64)"
        )
    if not isinstance(tensor, torch.Tensor):
        return (
            f"{what} is a {type(tensor).__name__}, not a tensor: rebuild the optimizer, or "
            "load a state dict saved for these parameters"
        )
    if tensor.numel() != numel and what in ("state['step']", "state['rng_seed']"):
        return (
            f"{what} holds {tensor.numel()} elements where it must hold one value, e.g. "
            "torch.tensor(0.0, dtype=torch.float64) for a step counter"
        )
    if tensor.numel() != numel:
        fix = (
            "was it replaced through `p.grad.data = ...`? Give each parameter a gradient of "
            "its own size"
            if what == "gradient"
            else "was the parameter resized (`p.data = ...`) after its state was made, or a "
            "state tensor replaced or emptied (`set_()`)? Rebuild the optimizer, or load a "
            "state dict saved for these parameters"
        )
        return (
            f"{what} holds {tensor.numel()} elements, its size does not match its "
            f"parameter's ({numel}): {fix}"
        )
    if dtype is not None and tensor.dtype != dtype:
        return (
            f"{what} is {tensor.dtype} where its format stores {dtype}: a state tensor "
            "replaced or cast by hand; load a state dict (load_state_dict converts what it "
            "can) instead of assigning state"
        )
    if dtype is not None and not tensor.is_contiguous():
        return (
            f"{what} is not laid out like its parameter (strides {tensor.stride()}): "
            "assign state tensors made like the parameter (torch.empty_like), or load a "
            "state dict"
        )
    return None


@functools.cache
def _unused_key(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def step_kernel(family: StepFamily, mode: KernelMode) -> StepKernel:
    """The process-wide kernel of `family` in `mode` (see `StepKernel`)."""
    block_size = int(getattr(family.moments, "block_size", 1))
    key = (
        family.rule.name,
        family.master.spec.name,
        family.moments.spec.name,
        family.maximize,
        block_size,
        mode,
    )
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = StepKernel(family, mode=mode)
    return kernel


@functools.cache
def family_of(
    rule_name: str, master: str, moments: str, *, maximize: bool, block_size: int
) -> StepFamily:
    """The family named by rule, formats and flags (the custom op's arguments)."""
    return StepFamily(
        rule=rule(rule_name),
        master=master_format(master),
        moments=moment_format(moments, block_size=block_size),
        maximize=maximize,
    )


#: Process-wide kernels by (rule, master, moments, maximize, block size, mode).
_KERNELS: dict[tuple[str, str, str, bool, int, str], StepKernel] = {}


def kernel_for(
    rule_name: str, master: str, moments: str, *, maximize: bool, block_size: int, mode: str
) -> StepKernel:
    """`step_kernel` looked up by names (what the custom op receives): this runs on
    every call, so it is one dictionary lookup."""
    key = (rule_name, master, moments, maximize, block_size, mode)
    kernel = _KERNELS.get(key)
    if kernel is None:
        family = family_of(rule_name, master, moments, maximize=maximize, block_size=block_size)
        # Also under the caller's key: a dense family is stored under block size 1.
        kernel = _KERNELS[key] = step_kernel(family, mode)  # type: ignore[arg-type]
    return kernel


def clear_kernels() -> None:
    """Forget the process-wide kernels (tests that change the environment they see)."""
    _KERNELS.clear()
