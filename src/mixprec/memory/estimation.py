"""The analytic estimate: memory by component and communication per step for a policy.

"Half the memory" claims fail because they count activations and forget masters,
moments, gradients and communication. `estimate` predicts every component (see
`mixprec.memory.breakdown`) for a module, a `TransformerShape` or a bare
parameter count, without allocating the model's memory; `mixprec.memory.measure`
measures the same components on a real step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mixprec.islands import island_param_names
from mixprec.memory.activations import saved_activation_bytes
from mixprec.memory.breakdown import Components, MemoryBreakdown, Sharding
from mixprec.memory.state_layout import state_nbytes
from mixprec.memory.transformer import TransformerShape
from mixprec.policy import Policy
from mixprec.policy import policy as get_policy

__all__ = ["estimate"]


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Tensor:
    """What the estimate knows about one parameter (or an aggregate of many)."""

    numel: int
    rows: int  # size of dim 0: FSDP2 shards along it
    island: bool
    aggregate: bool = False  # a count standing for many large tensors
    trainable: bool = True  # frozen: stored, but no gradient and no optimizer state


def _state_for(t: _Tensor, pol: Policy, numel: int) -> Components:
    dtype = torch.float32 if t.island else pol.param_dtype
    size = numel * _nbytes(dtype)
    if not t.trainable:  # optimizers make state at a parameter's first step: never here
        return Components(params=0 if t.island else size, fp32_islands=size if t.island else 0)
    master = "none" if dtype == torch.float32 else pol.master
    st = state_nbytes(
        numel,
        param_dtype=dtype,
        master=master,
        moments=pol.moments,
        quantizable=True if t.aggregate else None,
    )
    return Components(
        params=0 if t.island else size,
        fp32_islands=size if t.island else 0,
        grads=size,
        master=st["master"],
        moments=st["moments"],
    )


def estimate(
    model: nn.Module | int | float | TransformerShape,
    policy: Policy | str,
    *,
    world_size: int = 1,
    sharding: Sharding = "fsdp",
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    activation_values: float | None = None,
    device_type: str = "cpu",
) -> MemoryBreakdown:
    """Predict memory by component and communication per step for `policy`.

    Args:
        model: an `nn.Module` (exact per-tensor figures), a parameter count, or a
            `TransformerShape` (parameters and activations from the config).
        policy: a `Policy` or preset name.
        world_size: ranks; with ``sharding="fsdp"`` params, grads, master and
            moments are divided among them (FSDP2 shards each tensor along dim 0).
        sharding: ``fsdp`` (FSDP2), ``ddp`` (replicated), or ``none``.
        inputs, loss_fn, targets: an example micro-batch for a module: activations
            are then predicted by a fake-tensor forward (no memory used).
        activation_values: for a parameter count, the number of activation values
            saved for backward; bytes follow the compute dtype (fp32 without autocast).
        device_type: the device type autocast would run on.
    """
    pol = get_policy(policy)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if sharding not in ("none", "fsdp", "ddp"):
        raise ValueError(f"sharding must be one of none, fsdp, ddp; got {sharding!r}")
    if world_size > 1 and sharding == "none":
        raise ValueError("world_size > 1 needs sharding='fsdp' or 'ddp'")
    notes: list[str] = []
    compute_bytes = _nbytes(pol.effective_compute_dtype)
    tensors: list[_Tensor]
    act_rank = 0
    if isinstance(model, nn.Module):
        islands = island_param_names(model, pol)
        # Every parameter is stored (tied ones once: named_parameters skips repeats);
        # frozen ones get no gradient and no optimizer state.
        tensors = [
            _Tensor(
                p.numel(), p.shape[0] if p.dim() else 1, name in islands, False, p.requires_grad
            )
            for name, p in model.named_parameters()
        ]
        if any(not t.trainable for t in tensors):
            frozen = sum(t.numel for t in tensors if not t.trainable)
            notes.append(f"{frozen:,} frozen parameters: stored, no gradients or optimizer state")
        if inputs is not None:
            act_rank = saved_activation_bytes(
                model, inputs, policy=pol, loss_fn=loss_fn, targets=targets, device_type=device_type
            )
        else:
            notes.append("activations not estimated: pass inputs= (and loss_fn=) to include them")
    elif isinstance(model, TransformerShape):
        matrices, norms = model.param_counts()
        tensors = [
            _Tensor(matrices, matrices, False, aggregate=True),
            _Tensor(norms, norms, pol.param_dtype != torch.float32),
        ]
        compute_values, fp32_values = model.activation_values()
        act_rank = compute_values * compute_bytes + fp32_values * 4
        notes.append(
            "transformer parameters are counted as one large tensor per kind; activations assume "
            "fused attention and no dropout"
        )
    else:
        n = int(model)
        if n < 0 or n != model:
            raise ValueError(f"a parameter count must be a non-negative integer, got {model!r}")
        tensors = [_Tensor(n, n, False, aggregate=True)]
        notes.append("a bare parameter count: no fp32 islands, every tensor large")
    if activation_values is not None:
        act_rank = round(activation_values) * compute_bytes
    n_params = sum(t.numel for t in tensors)
    n_trainable = sum(t.numel for t in tensors if t.trainable)  # only these are reduced

    # One rank's state: FSDP2 gives every rank ceil(rows / W) rows of each tensor
    # (padded), DDP and single-device runs hold every tensor whole.
    rank0 = Components(activations=act_rank)
    for t in tensors:
        numel = t.numel
        if sharding == "fsdp" and world_size > 1:
            numel = _ceil_div(t.rows, world_size) * (t.numel // t.rows if t.rows else 0)
        rank0 = rank0 + _state_for(t, pol, numel)
    whole = _times(rank0, world_size)

    comm: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if world_size > 1:
        reduce_bytes = _nbytes(pol.reduce_dtype)
        if sharding == "fsdp":
            gather_bytes = sum(
                t.numel * (4 if t.island else _nbytes(pol.compute_dtype or pol.param_dtype))
                for t in tensors
            )
            comm["all_gather"] = 2 * gather_bytes  # forward, and again for backward
            comm["reduce_scatter"] = n_trainable * reduce_bytes
            notes.append("FSDP2 re-gathers parameters for backward (reshard_after_forward=True)")
        else:
            comm["all_reduce"] = n_trainable * reduce_bytes
    return MemoryBreakdown(
        policy=pol.name,
        params=n_params,
        world_size=world_size,
        sharding=sharding if world_size > 1 else "none",
        bytes=whole,
        per_rank=rank0,
        comm_bytes_per_step=comm,
        measured=False,
        notes=tuple(notes),
    )


def _times(c: Components, k: int) -> Components:
    return Components(**{f.name: getattr(c, f.name) * k for f in fields(c)})
