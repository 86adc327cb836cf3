"""A param group's step, gathered once: its parameters and state, by format family.

`gather_group` runs at the boundaries: a group added, state loaded or copied, a
parameter's first gradient (its state is made then), a parameter re-pointed
(``p.data = ...``) or put into the group by hand. It checks every state tensor
against its parameter and, where the native kernel takes a whole family, builds
that family's kernel table once (`native.NativeTable`).

Each step then reads only what documented use changes between steps: which
parameters have a gradient and each gradient's dtype, size, layout and device
(`GroupStep.run`), and the parameters' version counters and data pointers
(`GroupStep.current`). One call per family (a `StepBatch`): the native kernel
through its table with the new gradient pointers, else
``torch.ops.mixprec.step_`` (`mixprec.optim.ops`: compiled, eager, or the
native kernel with every check).

State tensors are the optimizer's: they change through its `load_state_dict`
(a boundary); one replaced or resized by hand between steps is not looked at
again until the next boundary, and such a step is undefined (the table keeps
the memory it points to alive, so it never reads freed memory).
"""

from __future__ import annotations

import array
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.errors import PrecisionError
from mixprec.optim import native, ops, sharding
from mixprec.optim.layout import flat_view, like_param
from mixprec.optim.native.binding import HYPER
from mixprec.optim.param_plan import ParamPlan
from mixprec.optim.rules import Hyper, Rule
from mixprec.optim.step_batch import StepBatch, kernel_for

__all__ = ["GroupStep", "follow_layout", "gather_group", "run_checked", "traced_step"]

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")
_NUMEL = torch.Tensor.numel
_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous
_HAS_GRAD = functools.partial(operator.is_not, None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclass
class GroupStep:
    """One param group's batches and what `current` compares each step."""

    group: dict[str, Any]
    rule: Rule  # the group's update rule (its `read` gives a step's hyperparameters)
    params: list[torch.Tensor]  # group["params"] when gathered
    pointers: list[int] | None  # their data pointers; None: gather again every step
    versions: list[int]  # their version counters when the optimizer last wrote them
    pending: list[torch.Tensor]  # parameters without state yet
    batches: list[StepBatch]
    version_of: Callable[[torch.Tensor], int] = _VERSION

    def known_versions(self) -> list[tuple[int, int]]:
        """(id, version counter when the optimizer last wrote it) of each parameter, for
        the next gather to keep; -1 for one whose storage was replaced since (``p.data =
        ...``, ``set_``, ``torch.nn.utils.vector_to_parameters``): new values the master
        must follow, as after an in-place edit."""
        pointers: list[int | None] = [None] * len(self.params)
        if self.pointers is not None:
            pointers = list(self.pointers)
        return [
            (id(p), version if ptr is None or _PTR(p) == ptr else -1)
            for p, version, ptr in zip(self.params, self.versions, pointers, strict=True)
        ]

    def current(self, group: dict[str, Any]) -> bool:
        """Whether the batches still describe `group`: the same parameters at the same
        addresses, and none without state that has a gradient now."""
        params = group["params"]
        return (
            group is self.group
            and self.pointers is not None
            and len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and list(map(_PTR, params)) == self.pointers
            and not (self.pending and any(map(_HAS_GRAD, map(_GRAD, self.pending))))
        )

    def run(self, hyper: Hyper, observed: bool) -> None:
        """One step of every parameter that has a gradient, one call per batch: the
        native kernel through the batch's table with the new gradient pointers, else
        `run_checked`. `observed`: tracing, the profiler or a dispatch mode is on (the
        step goes through the operator)."""
        for batch in self.batches:
            grads = list(map(_GRAD, batch.owners))
            table = batch.table
            if table is not None and not observed:
                try:  # a missing gradient raises TypeError, a sparse one RuntimeError
                    pointers = list(map(_PTR, grads))
                except (TypeError, RuntimeError):
                    pointers = []
                if not (
                    pointers
                    and list(map(_DTYPE, grads)) == batch.grad_dtypes
                    and list(map(_NUMEL, grads)) == batch.numels
                    and all(map(_CONTIGUOUS, grads))
                    and all(map(_IS_CPU, grads))
                    and native.PLAIN_TYPES.issuperset(map(type, grads))
                ):
                    pointers = _grad_pointers(batch, grads, table)
                if pointers:
                    table.table[table.grads] = array.array("q", pointers)
                    rc = table.fn(
                        *table.head,
                        table.address,
                        HYPER(*hyper),
                        table.block_size,
                        torch.get_num_threads(),
                        table.stream,
                    )
                    if rc != 0:
                        raise table.refused(rc)
                    # The kernel wrote through pointers: tell autograd (as `ops` does).
                    torch.autograd.graph.increment_version(batch.owners)
                    continue
            run_checked(batch, grads, hyper)


def _grad_pointers(
    batch: StepBatch, grads: list[torch.Tensor | None], table: native.NativeTable
) -> list[int]:
    """The gradient column for `grads` when `batch`'s table can take them (rows without
    a gradient get 0, and new gradient dtypes are written into the table), else []."""
    pointers: list[int] = []
    codes: list[int] = []
    for grad, numel, code in zip(grads, batch.numels, table.table[table.grad_dtypes], strict=True):
        if grad is None:
            pointers.append(0)
            codes.append(code)
            continue
        if (
            type(grad) not in _PLAIN
            or grad.dtype not in _DTYPE_CODES
            or grad.numel() != numel
            or not grad.is_cpu
            or not grad.is_contiguous()
            or grad.is_sparse
        ):
            return []
        pointers.append(grad.data_ptr())
        codes.append(_DTYPE_CODES[grad.dtype])
    if not any(pointers):
        return []
    table.table[table.grad_dtypes] = array.array("q", codes)
    batch.grad_dtypes = [_CODE_DTYPES[c] for c in codes]  # (what the fast check compares)
    return pointers


def run_checked(batch: StepBatch, grads: list[torch.Tensor | None], hyper: Hyper) -> None:
    """The step of `batch`'s parameters with a gradient (`grads`: their ``.grad``)
    through the operator, every tensor checked (`StepKernel.run`)."""
    rows = [i for i, g in enumerate(grads) if g is not None]
    if not rows:
        return
    batch.family.rule.check(hyper, batch.index)
    call = batch.select(rows, grads=[_local_grad(batch.owners[i], grads[i]) for i in rows])
    misfit = None if torch.compiler.is_compiling() else batch.kernel.misfit(call)
    if misfit is not None:
        raise ValueError(f"param group {batch.index} was not stepped: {misfit}")
    ops.step_(call, hyper)


def _local_grad(p: torch.Tensor, grad: Any) -> torch.Tensor:
    """`p`'s gradient laid out as the kernel takes it (like its local data)."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"gradient of parameter {tuple(p.shape)} is not a tensor: {grad!r}")
    if grad.is_sparse:
        raise ValueError("mixprec's optimizers do not support sparse gradients")
    if sharding.is_dtensor(p) != sharding.is_dtensor(grad) or (
        sharding.is_dtensor(p) and grad.placements != p.placements  # type: ignore[attr-defined]
    ):
        got = getattr(grad, "placements", "a plain tensor")
        want = getattr(p, "placements", "a plain tensor")
        raise ValueError(
            f"gradient of parameter {tuple(p.shape)} is {got} but the parameter is "
            f"{want}; mixprec's optimizers step each shard locally and need them sharded alike"
        )
    lp = sharding.local(p.detach())
    local = like_param(sharding.local(grad), lp)
    return local if lp.is_contiguous() else flat_view(local)


def _repeat_rounds(params: list[torch.Tensor]) -> list[int] | None:
    """For a group that lists a parameter more than once: each entry's round (0 for its
    first listing, 1 for its second...); None when each is listed once. A later round
    runs after the earlier one (one call must not update the same memory twice)."""
    if len(set(map(id, params))) == len(params):
        return None
    seen: dict[int, int] = {}
    rounds = []
    for p in params:
        rounds.append(seen.get(id(p), 0))
        seen[id(p)] = rounds[-1] + 1
    return rounds


def follow_layout(lp: torch.Tensor, state: dict[str, torch.Tensor], plan: ParamPlan) -> None:
    """Lay `state`'s per-element tensors out like `lp` again if the parameter's layout
    changed since they were made (``module.to(memory_format=...)`` assigns ``p.data``):
    the step pairs state with parameter in memory order, so their strides must agree."""
    for key in plan.element_keys:
        t = state[key]
        if t.stride() != lp.stride() and t.shape == lp.shape:
            relaid = torch.empty_like(lp, dtype=t.dtype)
            relaid.copy_(t)
            state[key] = relaid


def gather_group(
    group: dict[str, Any],
    index: int,
    *,
    rule: Rule,
    plans: dict[torch.Tensor, ParamPlan],
    state: dict[torch.Tensor, Any],
    make_state: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None,
    block_size: int,
    versions: dict[int, int],
) -> GroupStep:
    """`group`'s batches (see the module), stepped by `rule`. `make_state`: makes the
    state of a parameter with a gradient and none yet (at a step; None elsewhere: such
    parameters wait). `versions`: by ``id(p)``, the version counters the optimizer last left (the
    others are taken as they are now: their state matches them).

    Raises:
        ValueError: a state tensor does not fit its parameter, or two share memory.
        PrecisionError: a parameter's dtype changed since its formats were planned.
    """
    params = list(group["params"])
    tracing = torch.compiler.is_compiling()
    rounds = _repeat_rounds(params)
    keyed: dict[tuple[object, ...], StepBatch] = {}
    pending: list[torch.Tensor] = []
    reusable = True
    for i, p in enumerate(params):
        plan = plans[p]
        st = state.get(p)
        if not st:
            if make_state is None or p.grad is None:
                pending.append(p)
                continue
            st = make_state(p)
        if p.dtype != plan.dtype:
            raise PrecisionError(
                f"parameter {tuple(p.shape)} was {dtype_name(plan.dtype)} when this optimizer was "
                f"built (master {plan.master.spec.name!r}) and is {dtype_name(p.dtype)} now; "
                "its master and moments no longer fit: cast the model (or prec.prepare it) "
                "before building the optimizer"
            )
        lp = sharding.local(p.detach())
        dtensor = sharding.is_dtensor(p)
        if not dtensor:
            follow_layout(lp, st, plan)
        masters = [sharding.local(st[k]) for k in plan.master_keys]
        moments = [sharding.local(st[k]) for k in plan.moment_keys]
        if not lp.is_contiguous():  # dense in another order (channels-last): flat views
            lp = flat_view(lp)
            masters = [flat_view(t) for t in masters]
            moments = [flat_view(t) for t in moments]
        reusable = reusable and type(p) in _PLAIN
        key = (plan.batch_key, lp.device, rounds[i] if rounds else 0)
        batch = keyed.get(key)
        if batch is None:
            kernel = kernel_for(
                plan.rule.name,
                plan.master.spec.name,
                plan.moments.spec.name,
                maximize=bool(group["maximize"]),
                block_size=block_size,
                mode=plan.mode,
            )
            batch = keyed[key] = StepBatch(kernel, block_size, index=index)
        batch.owners.append(p)
        batch.params.append(lp)
        batch.grads.append(lp)  # (stand-ins of the gradients' size: checked each step)
        batch.master_state.extend(masters)
        batch.moment_state.extend(moments)
        batch.steps.append(st["step"])
        batch.offsets.append((sharding.global_flat_offset(p) or 0) if dtensor else 0)
        batch.column_groups.append(
            sharding.column_group(p) if dtensor and plan.column_keys else None
        )
        if plan.uses_noise:
            batch.seeds.append(st["rng_seed"])
    version_of = _VERSION if reusable else sharding.write_version
    out = GroupStep(
        group,
        rule,
        params,
        list(map(_PTR, params)) if reusable and not tracing else None,
        [] if tracing else [versions.get(id(p), version_of(p)) for p in params],
        pending,
        list(keyed.values()),
        version_of,
    )
    if not tracing:
        for batch in out.batches:
            _check_and_prepare(batch)
    return out


def _check_and_prepare(batch: StepBatch) -> None:
    """Check `batch`'s state against its parameters, and build its native table where
    the kernel takes every row."""
    misfit = batch.kernel.misfit(batch)
    if misfit is not None:
        raise ValueError(f"param group {batch.index} was not stepped: {misfit}")
    library = batch.kernel.native
    if (
        library is None
        or any(batch.column_groups)  # (reduced across ranks: the eager step)
        or type(batch.owners[0]) not in _PLAIN
        or not all(map(_NUMEL, batch.params))  # (an empty tensor's pointer is 0)
        or len(batch.kernel.native_indices(batch)) != len(batch.params)
    ):
        return
    batch.table = library.prepare(batch, retain=True)
    batch.grad_dtypes = list(map(_DTYPE, batch.params))
    batch.numels = list(map(_NUMEL, batch.params))


def traced_step(
    groups: list[dict[str, Any]],
    rules: list[Rule],
    plans: dict[torch.Tensor, ParamPlan],
    state: dict[torch.Tensor, Any],
    make_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    block_size: int,
) -> None:
    """The step inside ``torch.compile``: every group gathered afresh (no pointers, no
    tables) and stepped through the operator, which tracing records as one node."""
    for index, (group, rule) in enumerate(zip(groups, rules, strict=True)):
        gs = gather_group(
            group,
            index,
            rule=rule,
            plans=plans,
            state=state,
            make_state=make_state,
            block_size=block_size,
            versions={},
        )
        hyper = rule.read(group)
        for batch in gs.batches:
            run_checked(batch, [p.grad for p in batch.owners], hyper)
