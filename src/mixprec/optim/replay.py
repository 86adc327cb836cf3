"""A param group's native step, prepared once and replayed while nothing it read has moved.

On a small model the step's arithmetic is cheaper than its Python: per
parameter, `AdamW.step` looks up its plan and state, checks its edits and
formats, and the native kernel's table is rebuilt and re-checked (about 7 us a
parameter against 1-2 us of kernel time on shakespeare-small, see
docs/benchmarks.md). After a group's step ran through that full path,
`prepare_group` keeps what it read: the parameters, their state dicts and
state tensors, and the kernel's checked table (`native.PreparedStep`). The next
step `PreparedGroup.replay` re-checks, with C-level loops over lists, every
fact the table depends on that can change between steps, and replays it with
the new gradients' pointers:

* the group: the same parameters in the same order, formats and ``maximize``
  as prepared, and the same parameters with and without gradients;
* each parameter: its version counter as the last step left it (an in-place
  edit, which the full path turns into a master resync), its data pointer,
  dtype, size and contiguity (``p.data = ...`` moves none of the counters);
* its state: the same dict in ``optimizer.state`` and the same tensor under each
  key (``load_state_dict``, a replaced entry);
* each gradient: a plain contiguous CPU tensor of the prepared dtype and size
  (a new tensor every step after ``zero_grad(set_to_none=True)``: only its
  pointer enters the table).

Anything else that changes what the full path would do (a state load, a master
resync, traced steps' writes) retires every prepared group of the optimizer.
When a check fails, `replay` returns False and the caller takes the full path,
which raises, resyncs or re-plans as it always does, then prepares the group
again.

The state tensors are not re-read: their values change only in place (the
kernel writes them through their pointers) and the table holds views of them,
so their memory stays valid; re-pointing one (``state[k].data = ...`` or
``set_``) is not followed (assign a new tensor to ``state[k]`` instead).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec import ctrl_c
from mixprec.optim import native
from mixprec.optim.batches import GroupHyper, StepBatch, StepKernel
from mixprec.optim.param_plan import ParamPlan

__all__ = ["PreparedGroup", "counter_value", "prepare_group", "wrote"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")


@dataclass
class _Call:
    """One native call of a prepared group: the parameters of one family."""

    members: list[int]  # positions in group["params"]
    whole: bool  # every parameter of the group, in order
    params: list[torch.Tensor]
    state_dicts: list[dict[str, torch.Tensor]]
    # Each state tensor with the dict and key it was read from.
    owners: list[dict[str, torch.Tensor]]
    keys: list[str]
    state_tensors: list[torch.Tensor]
    # Where each state tensor's data lives, how much of it there is, its dtype (and, in
    # `unchanged`, that it is contiguous): the prepared table points there, and
    # `state[k].data = t` or `set_` can change any of these without a new object.
    state_pointers: list[int]
    state_numels: list[int]
    state_dtypes: list[torch.dtype]
    pointers: list[int]
    dtypes: list[torch.dtype]
    numels: list[int]
    versions: list[int]  # as the last step left them
    prepared: native.PreparedStep
    # The first parameter's step counter, and its value when the step under way began
    # (`PreparedGroup.arm`): `PreparedGroup.writes` tells from the two whether a run
    # that was interrupted had written.
    step_counter: torch.Tensor
    step_before: float | None
    # `params` and a private marker, bumped together by one C call after the kernel
    # wrote: the marker's version says whether the parameters' bump happened, so an
    # edit in the window between the write and the bump is told from the bump.
    bump: list[torch.Tensor]
    marker: torch.Tensor
    marker_before: int = 0
    versions_before: list[int] | None = None  # `versions` when the replay under way began

    def unchanged(self, state_get: Callable[[torch.Tensor], object]) -> bool:
        """Whether the parameters and their state are as prepared (see the module)."""
        params = self.params
        return (
            list(map(_VERSION, params)) == self.versions
            and list(map(torch.Tensor.data_ptr, params)) == self.pointers
            and list(map(_DTYPE, params)) == self.dtypes
            and list(map(torch.Tensor.numel, params)) == self.numels
            and all(map(torch.Tensor.is_contiguous, params))
            and all(map(operator.is_, map(state_get, params), self.state_dicts))
            and all(map(operator.is_, map(dict.get, self.owners, self.keys), self.state_tensors))
            and list(map(torch.Tensor.data_ptr, self.state_tensors)) == self.state_pointers
            and list(map(torch.Tensor.numel, self.state_tensors)) == self.state_numels
            and list(map(_DTYPE, self.state_tensors)) == self.state_dtypes
            and all(map(torch.Tensor.is_contiguous, self.state_tensors))
        )


class PreparedGroup:
    """One param group's prepared native step (`prepare_group`); `replay` runs it."""

    def __init__(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grad_types: list[type],
        calls: list[_Call],
    ) -> None:
        self.group = group
        self._params = params
        self._grad_types = grad_types
        self._formats = _fixed_options(group)
        self._calls = calls

    def replay(
        self, group: dict[str, Any], state: dict[torch.Tensor, Any], hyper: GroupHyper
    ) -> bool:
        """Step `group` with the prepared calls if every check of the module passes
        (True); otherwise change nothing and return False (take the full path).
        `hyper`: the group's hyperparameters as `AdamW.step` checked them.

        Raises:
            ValueError: the kernel refused a step counter (as the full path would).
        """
        params = group["params"]
        if (
            len(params) != len(self._params)
            or not all(map(operator.is_, params, self._params))
            or _fixed_options(group) != self._formats
        ):
            return False
        grads = list(map(_GRAD, params))
        if list(map(type, grads)) != self._grad_types:
            return False
        state_get = state.get
        runs: list[tuple[_Call, list[int]]] = []
        for call in self._calls:  # every check before any write
            if not call.unchanged(state_get):
                return False
            pointers = call.prepared.gradient_pointers(
                grads if call.whole else [grads[i] for i in call.members]
            )
            if pointers is None:
                return False
            runs.append((call, pointers))
        values = (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay)
        for call, pointers in runs:
            # A Ctrl-C between the write and its recording would make the write look
            # like an edit of the user's (see `AdamW._reconcile`): held until recorded.
            with ctrl_c.held():
                call.prepared.run(pointers, values)
                # The kernel wrote through pointers: tell autograd (as `ops.adamw_step_` does).
                torch.autograd.graph.increment_version(call.bump)  # (with the marker)
                call.versions = list(map(_VERSION, call.params))
                call.step_before = None  # recorded: no longer a write to reconcile
        return True

    def arm(self) -> None:
        """Note each call's step counter before a replay (`writes` compares)."""
        for call in self._calls:
            call.step_before = counter_value(call.step_counter)
            call.marker_before = call.marker._version
            call.versions_before = call.versions  # (a replay rebinds, never mutates, it)

    def writes(self) -> list[tuple[list[torch.Tensor], list[int], bool, bool]]:
        """For a replay that was interrupted (after `arm`): per call, its parameters,
        their versions before it, whether its kernel wrote (one C call, all or
        nothing, that also advances the step counters) and whether their versions
        were bumped for it since."""
        return [
            (
                call.params,
                call.versions if call.versions_before is None else call.versions_before,
                wrote(call.step_counter, call.step_before),
                call.marker._version != call.marker_before,
            )
            for call in self._calls
        ]

    def versions(self) -> list[tuple[torch.Tensor, int]]:
        """Each prepared parameter's version counter as the last step left it (what
        `AdamW` records in the full path; `replay` keeps them here)."""
        pairs = (zip(call.params, call.versions, strict=True) for call in self._calls)
        return [pair for call_pairs in pairs for pair in call_pairs]


def counter_value(counter: object) -> float | None:
    """A step counter's value, or None when it is not a 1-element tensor (the step
    refuses it before writing anything)."""
    if isinstance(counter, torch.Tensor) and counter.numel() == 1:
        return float(counter)
    return None


def version_marker() -> torch.Tensor:
    """A tensor of no elements bumped with parameters in one call: its version says
    whether their bump happened (`PreparedGroup.writes`, `AdamW._reconcile`)."""
    with torch.inference_mode(False):  # (an inference tensor has no version counter)
        return torch.empty(0)


def wrote(counter: object, before: float | None) -> bool:
    """Whether a native call whose step counter held `before` has written since."""
    now = counter_value(counter)
    return before is not None and now is not None and now != before


def _fixed_options(group: dict[str, Any]) -> tuple[object, ...]:
    """What a prepared step was made with beyond the hyperparameters: the formats,
    ``maximize`` and the options the full path refuses (`options.refuse_unsupported`)
    if an edit of the group turns them on."""
    get = group.get
    return (
        group["master"],
        group["moments"],
        bool(group["maximize"]),
        get("amsgrad"),
        get("capturable"),
        get("differentiable"),
        get("decoupled_weight_decay", True),
    )


def prepare_group(
    group: dict[str, Any],
    *,
    plans: dict[torch.Tensor, ParamPlan],
    state: dict[torch.Tensor, Any],
    kernel_of: Callable[[ParamPlan], StepKernel],
) -> PreparedGroup | None:
    """`group`'s step as the native kernel would run it now, prepared for `replay`;
    None unless every parameter with a gradient is a plain contiguous CPU tensor
    with state and a gradient of the same kind, and the native kernel takes all
    of them (one call per family). A group listing a parameter twice is not
    prepared (its second step must follow the first: `AdamW.step`'s rounds)."""
    params = list(group["params"])
    if len(set(map(id, params))) != len(params):
        return None
    grads = list(map(_GRAD, params))
    families: dict[tuple[str, str, str], list[int]] = {}
    for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
        if grad is None:
            continue
        plan = plans[p]
        st = state.get(p)
        if (
            not st
            or type(p) not in _PLAIN
            or type(grad) not in _PLAIN
            or p.dtype != plan.dtype
            or grad.is_sparse
            or not p.is_contiguous()
            or not grad.is_contiguous()
        ):
            return None
        families.setdefault(plan.batch_key, []).append(i)
    if not families:
        return None
    calls: list[_Call] = []
    for members in families.values():
        call = _prepare_call(params, grads, members, plans, state, kernel_of)
        if call is None:
            return None
        calls.append(call)
    return PreparedGroup(group, params, list(map(type, grads)), calls)


def _prepare_call(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    members: list[int],
    plans: dict[torch.Tensor, ParamPlan],
    state: dict[torch.Tensor, Any],
    kernel_of: Callable[[ParamPlan], StepKernel],
) -> _Call | None:
    plan = plans[params[members[0]]]
    batch = StepBatch()
    owners: list[dict[str, torch.Tensor]] = []
    keys: list[str] = []
    ps = [params[i] for i in members]
    for p, i in zip(ps, members, strict=True):
        st = state[p]
        grad = grads[i]
        assert grad is not None
        batch.params.append(p)
        batch.grads.append(grad)
        batch.master_state.extend(st[k] for k in plan.master_keys)
        batch.moment_state.extend(st[k] for k in plan.moment_keys)
        batch.steps.append(st["step"])
        batch.offsets.append(0)
        used = [*plan.master_keys, *plan.moment_keys, "step"]
        if plan.uses_noise:
            batch.seeds.append(st["rng_seed"])
            used.append("rng_seed")
        owners.extend([st] * len(used))
        keys.extend(used)
    prepared = kernel_of(plan).prepare_native(batch)
    if prepared is None:
        return None
    return _Call(
        members=members,
        whole=members == list(range(len(params))),
        params=ps,
        state_dicts=[state[p] for p in ps],
        owners=owners,
        keys=keys,
        state_tensors=(tensors := [o[k] for o, k in zip(owners, keys, strict=True)]),
        state_pointers=list(map(torch.Tensor.data_ptr, tensors)),
        state_numels=list(map(torch.Tensor.numel, tensors)),
        state_dtypes=list(map(_DTYPE, tensors)),
        pointers=list(map(torch.Tensor.data_ptr, ps)),
        dtypes=list(map(_DTYPE, ps)),
        numels=list(map(torch.Tensor.numel, ps)),
        versions=list(map(_VERSION, ps)),
        prepared=prepared,
        step_counter=state[ps[0]]["step"],
        step_before=counter_value(state[ps[0]]["step"]),
        bump=[*ps, marker := version_marker()],
        marker=marker,
    )
