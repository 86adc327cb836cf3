"""What each parameter of an optimizer gets: its rule, formats, kernel mode and fresh state.

Resolved once per parameter when its group is added (`plan_param`); the state
itself is made at the parameter's first step (`fresh_state`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.formats import (
    MasterFormat,
    MomentFormat,
    master_spec,
    moment_format,
    resolve_master,
)
from mixprec.formats.moments import Int4Moments, Int8Moments
from mixprec.optim import sharding
from mixprec.optim.kernels import KernelMode
from mixprec.optim.layout import is_dense
from mixprec.optim.rng import derive_seed
from mixprec.optim.rules import Rule

__all__ = [
    "ParamPlan",
    "check_masters_have_16bit_params",
    "check_param",
    "fresh_state",
    "plan_param",
    "refuse_params_in_two_groups",
    "refuse_shared_memory",
]


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's update rule, formats and kernel mode.

    Attributes:
        rule: its group's update rule.
        master: how its full precision is kept.
        moments: how its moments are stored.
        mode: how its step runs (native, compiled, eager).
        dtype: the parameter's dtype the formats were resolved for.
        index: the parameter's position when added (derives its rounding seed).
        requested: the group's ``(master, moments)`` when the plan was made.
        batch_key: what parameters stepped by one kernel call share (rule, formats, mode).
        master_keys: the master's state keys, in kernel order.
        moment_keys: the moments' state keys, in kernel order.
        uses_noise: whether the master draws stochastic-rounding noise.
        element_keys: the state keys holding one value per element (laid out like
            the parameter), masters first.
    """

    rule: Rule
    master: MasterFormat
    moments: MomentFormat
    mode: KernelMode
    dtype: torch.dtype
    index: int
    requested: tuple[str, str] = ("auto", "fp32")
    batch_key: tuple[str, str, str, str] = field(init=False)
    master_keys: tuple[str, ...] = field(init=False)
    moment_keys: tuple[str, ...] = field(init=False)
    uses_noise: bool = field(init=False)
    element_keys: tuple[str, ...] = field(init=False)
    column_keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Read on every step for every parameter: computed once here.
        names = (self.rule.name, self.master.spec.name, self.moments.spec.name, self.mode)
        object.__setattr__(self, "batch_key", names)
        object.__setattr__(self, "master_keys", self.master.spec.state_keys)
        moment_state = self.moments.spec.state_for(self.rule.slots)
        object.__setattr__(self, "moment_keys", tuple(t.name for t in moment_state))
        object.__setattr__(self, "uses_noise", self.master.spec.uses_noise)
        per_element = tuple(t.name for t in moment_state if t.per_element)
        object.__setattr__(self, "element_keys", self.master.spec.state_keys + per_element)
        # Statistics spanning every row (int4's column maxima): whole on every rank.
        object.__setattr__(self, "column_keys", tuple(t.name for t in moment_state if t.per_column))


def check_param(p: torch.Tensor) -> None:
    """Refuse a parameter the step cannot update faithfully."""
    if not p.is_floating_point():
        raise ValueError(
            f"mixprec's optimizers need floating params, got {dtype_name(p.dtype)}: use "
            "the torch optimizer for complex or integer parameters"
        )
    if p.dtype == torch.float64:
        raise ValueError(
            f"parameter {tuple(p.shape)} is float64: mixprec's optimizers compute the "
            "update in fp32 and would silently drop fp64 precision; use the torch "
            "optimizer for fp64 parameters, or cast them to fp32"
        )
    local = sharding.local(p.detach())  # the local shard of a DTensor
    dense = local.is_contiguous() if sharding.is_dtensor(p) else is_dense(local)
    if not dense:
        raise ValueError(
            f"parameter of shape {tuple(p.shape)} with strides {local.stride()} has gaps or "
            "overlaps in memory; mixprec's optimizers update parameters as one run of memory "
            "(contiguous or channels-last): make it .contiguous() first"
        )


def check_masters_have_16bit_params(groups: Sequence[dict[str, Any]]) -> None:
    """A master applies to the 16-bit parameters (fp32 ones are their own master); one
    asked for where every parameter is fp32 means the model was not cast: say so."""
    params = [p for g in groups for p in g["params"]]
    if not params or any(p.dtype != torch.float32 for p in params):
        return
    for group in groups:
        if group["master"] not in ("auto", "none"):
            master_spec(group["master"]).check_param_dtype(torch.float32)


def refuse_params_in_two_groups(groups: Sequence[dict[str, Any]]) -> None:
    """`add_param_group` refuses a parameter already in a group; an edit of
    `param_groups` can still put one in two (a list shared by two groups, say)."""
    ids = [{id(p) for p in g["params"]} for g in groups]
    if len(set().union(*ids)) != sum(map(len, ids)):
        raise ValueError(
            "a parameter is in two param groups (param_groups edited directly); an "
            "optimizer steps each parameter in one group"
        )


def refuse_shared_memory(params: Sequence[torch.Tensor]) -> None:
    """Refuse two different parameters whose memory overlaps (``Parameter(buf)`` twice, or
    slices of one tensor): each would be stepped with its own state over the same memory,
    and the paths would not even agree on the order. Tie weights as one Parameter."""
    spans = []
    seen: set[int] = set()
    for i, p in enumerate(params):
        if id(p) in seen:
            continue  # the same parameter listed again (torch warns; stepped in turn)
        seen.add(id(p))
        local = sharding.local(p.detach())
        if local.numel() == 0 or local.device.type == "meta":
            continue
        start = local.data_ptr()
        spans.append((local.device, start, start + local.numel() * local.element_size(), i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for (dev_a, _, end_a, i), (dev_b, start_b, _, j) in itertools.pairwise(spans):
        if dev_a == dev_b and start_b < end_a:
            a, b = sorted((i, j))
            raise ValueError(
                f"parameters {a} {tuple(params[a].shape)} and {b} {tuple(params[b].shape)} "
                "share memory: each would take its own step over the same values; tie "
                "them as one Parameter (module.b.weight = module.a.weight) instead"
            )


def plan_param(
    p: torch.Tensor,
    group: dict[str, Any],
    *,
    rule: Rule,
    mode: KernelMode,
    index: int,
    block_size: int,
    min_int8_numel: int,
) -> ParamPlan:
    """The formats `group` asks for, fitted to `p`: ``auto`` resolved by its dtype; an fp32
    parameter is its own master (``none``: an fp32 island in a bf16 model shares its
    group); blockwise moments only for tensors of whole blocks, others keep fp32 moments
    (as does a rule that keeps no moments: it stores none); int4 moments only for
    tensors `Int4Moments.fits`, sharded (if at all) on dim 0 over one mesh dim, and
    int8's rule for the others (the next narrowest format)."""
    requested = group["master"]
    if p.dtype == torch.float32 and requested != "auto":
        requested = "none"
    master = resolve_master(requested, p.dtype)
    moments = moment_format(group["moments"] if rule.slots else "fp32", block_size=block_size)
    if isinstance(moments, Int4Moments):  # where int4 does not fit, int8's rule decides
        fits = (
            sharding.local(p.detach()).is_contiguous()
            and p.numel() >= min_int8_numel
            and Int4Moments.fits(tuple(p.shape))
            and sharding.column_stats_fit(p)
        )
        if not fits:
            moments = moment_format("int8", block_size=block_size)
    if isinstance(moments, Int8Moments):
        whole_blocks = (
            sharding.local(p.detach()).is_contiguous()  # blocks run in row-major order
            and p.numel() >= min_int8_numel
            and p.numel() % block_size == 0
            and sharding.int8_blocks_fit(p, block_size, moments.scale_shape(p.shape))
        )
        if not whole_blocks:
            moments = moment_format("fp32")
    requested_formats = (group["master"], group["moments"])
    return ParamPlan(rule, master, moments, mode, p.dtype, index, requested_formats)


def fresh_state(p: torch.Tensor, plan: ParamPlan, seed: int) -> dict[str, torch.Tensor]:
    """New state for `p`: master equal to the parameter as it is now, zero moments, step 0."""
    lp = sharding.local(p.detach())  # the local shard of a DTensor param
    # float64: exact to 2**53 steps (float32 stops counting at 2**24, which would
    # freeze the bias correction and repeat the stochastic-rounding noise).
    state: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float64, device=p.device)}
    state.update(plan.master.init_state(lp))
    state.update(plan.moments.init_state(lp, plan.rule.slots))
    if plan.master.spec.uses_noise:
        param_seed = derive_seed(seed, plan.index)
        state["rng_seed"] = torch.tensor(param_seed, dtype=torch.int64, device=p.device)
    if sharding.is_dtensor(p):
        # Sharded like the param, with the shapes an unsharded param's state has.
        whole = torch.empty(p.shape, dtype=p.dtype, device="meta")
        shapes = {
            **plan.master.init_state(whole),
            **plan.moments.init_state(whole, plan.rule.slots),
        }
        # Column statistics span every row: each rank holds them whole (reduced each step).
        state = {
            k: sharding.replicate_like(v, p)
            if k in plan.column_keys
            else sharding.shard_like(v, p, shapes[k].shape)
            if k in shapes
            else v
            for k, v in state.items()
        }
    return state
