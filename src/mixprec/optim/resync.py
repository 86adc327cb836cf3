"""Masters against parameters: reset after an edit, read out, written in.

Training code writes weights in place between steps: loading other weights,
re-initialising a layer, magnitude pruning (``w.mul_(mask)``), ``p.zero_()``.
A remainder or compensation is relative to the value the optimizer last wrote,
and which elements an edit changed cannot be told from the new values alone
(the old remainder joined with a new value is still a valid master within half
an ulp of it). So one rule: a parameter whose version counter moved since the
optimizer last wrote it gets `reset_master`, its master becomes the parameter's
value exactly (remainder 0, compensation 0, fp32 copy = parameter). Elements
the edit left alone lose their sub-16-bit part once (at most half an ulp); a
master never decodes to NaN. `decode_master` and `encode_master` read a
master out as fp32 and write one in (`AdamW.master_weights` and its inverse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from mixprec.formats import MasterFormat
from mixprec.optim import sharding
from mixprec.optim.group_step import follow_layout
from mixprec.optim.layout import flat_view, like_param
from mixprec.optim.param_plan import ParamPlan

if TYPE_CHECKING:
    from mixprec.optim.group_step import GroupStep

__all__ = ["check_weights", "decode_master", "encode_master", "follow_edits", "reset_master"]


@torch.no_grad()
def reset_master(fmt: MasterFormat, param: torch.Tensor, state: list[torch.Tensor]) -> None:
    """Make the master equal to `param` exactly (`state` in `state_keys` order, in place)."""
    if not fmt.spec.state_keys:
        return
    fresh = fmt.init_state(param)
    for dst, key in zip(state, fmt.spec.state_keys, strict=True):
        src = fresh[key]
        # (a parameter re-pointed by `p.set_(t)` to another shape of the same size: its
        # state keeps its shape, and is stepped element by element as after `p.data = t`)
        dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))


def follow_edits(gs: GroupStep) -> None:
    """Reset the master of each parameter of `gs` written in place since the optimizer
    last wrote it (the one rule: see the module), through the batches' local views."""
    pairs = zip(gs.params, gs.versions, strict=True)
    edited = {id(p) for p, before in pairs if gs.version_of(p) != before}
    for batch in gs.batches:
        n = batch.kernel.n_master
        for i, p in enumerate(batch.owners):
            if id(p) in edited:
                state = batch.master_state[i * n : (i + 1) * n]
                reset_master(batch.kernel.family.master, batch.params[i], state)
    gs.versions = list(map(gs.version_of, gs.params))


@torch.no_grad()
def decode_master(
    p: torch.Tensor, plan: ParamPlan, state: dict[str, torch.Tensor] | None
) -> torch.Tensor:
    """`p`'s fp32 master value as a new tensor (`p` upcast where it has no state yet; a
    DTensor parameter gets a DTensor sharded like it)."""
    lp = sharding.local(p.detach())
    if state and not sharding.is_dtensor(p):
        follow_layout(lp, state, plan)
    state = state or plan.master.init_state(lp)
    flat_state = [flat_view(sharding.local(state[k])) for k in plan.master.spec.state_keys]
    value = plan.master.decode(flat_view(lp), flat_state).to(torch.float32)
    out = torch.empty_like(lp, dtype=torch.float32)
    flat_view(out).copy_(value)
    return sharding.shard_like(out, p, p.shape)


@torch.no_grad()
def encode_master(
    p: torch.Tensor,
    plan: ParamPlan,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor] | None,
    make_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Write fp32 `weight` into `p` (rounded as its master rounds; ``stochastic`` and
    ``none``: to nearest) and the rest into its master (state made where needed)."""
    lp = sharding.local(p.detach())
    value = flat_view(like_param(sharding.local(weight).to(lp.device, torch.float32), lp))
    if plan.uses_noise or not plan.master_keys:
        flat_view(lp).copy_(value)  # round to nearest: no master to keep the rest
        return
    stored, kept = plan.master.encode(value, dtype=lp.dtype, noise=None)
    flat_view(lp).copy_(stored)
    if not state:
        if not any(bool(t.any()) for t in kept):
            return  # the value fits the parameter: no state needed yet (lazy)
        state = make_state(p)
    for key, src in zip(plan.master_keys, kept, strict=True):
        flat_view(sharding.local(state[key])).copy_(src)


def check_weights(params: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """One weight per parameter, shaped like it (`AdamW.load_master_weights`)."""
    if len(weights) != len(params):
        raise ValueError(f"got {len(weights)} weights for {len(params)} parameters")
    for i, (p, w) in enumerate(zip(params, weights, strict=True)):
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(
                f"weight {i} has shape {tuple(w.shape)}, its parameter {tuple(p.shape)}"
            )
