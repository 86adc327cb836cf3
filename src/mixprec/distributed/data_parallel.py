"""`ddp`: DistributedDataParallel whose gradients are reduced in the policy's dtype.

DDP reduces gradients in their own dtype (bf16 gradients of 16-bit storage in
bf16, fp32 ones in fp32) unless a communication hook says otherwise, and
PyTorch's built-in compression hooks are fixed to one dtype (and its bf16 one
refuses gloo). `reduce_in_dtype` is one hook for every case: each bucket is
cast to the policy's ``reduce_dtype`` (when it differs), divided by the world
size, all-reduced, and written back into the bucket, on gloo and NCCL alike.
With fp32 gradients and an fp32 reduce dtype it does exactly what DDP's default
all-reduce does (divide, then sum), bit for bit.
"""

# No ``from __future__ import annotations`` here: DDP reads the hook's annotations at
# run time and accepts only the real ``dist.GradBucket`` and ``Future[Tensor]``.

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed.fsdp import policy_of, set_storage
from mixprec.distributed.launch import require_process_group
from mixprec.engine.wrappers import mark_ddp_reduce_dtype
from mixprec.policy import Policy

if TYPE_CHECKING:
    from mixprec.engine import Precision

__all__ = ["ReduceHookState", "ddp", "reduce_in_dtype"]


@dataclass(frozen=True)
class ReduceHookState:
    """The state of `reduce_in_dtype`: the dtype to reduce in and the group (None:
    the default group)."""

    reduce_dtype: torch.dtype
    process_group: dist.ProcessGroup | None = None


def reduce_in_dtype(
    state: ReduceHookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients in ``state.reduce_dtype``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer: torch.Tensor = bucket.buffer()
    payload = buffer if buffer.dtype == state.reduce_dtype else buffer.to(state.reduce_dtype)
    payload.div_(world)
    work = cast(dist.Work, dist.all_reduce(payload, group=group, async_op=True))

    def write_back(fut: torch.futures.Future[Any]) -> torch.Tensor:
        reduced: torch.Tensor = fut.value()[0]
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    future: torch.futures.Future[torch.Tensor] = work.get_future().then(write_back)
    return future


def ddp(
    model: nn.Module,
    policy_arg: "Policy | str | Precision",
    *,
    process_group: dist.ProcessGroup | None = None,
    **ddp_kwargs: Any,
) -> torch.nn.parallel.DistributedDataParallel:
    """Wrap `model` in `DistributedDataParallel` reducing in the policy's ``reduce_dtype``.

    The policy's storage is set first (fp32 islands, 16-bit parameters), as
    `Precision.prepare` does, then DDP wraps the model and `reduce_in_dtype` is
    registered. Call it on every rank, after ``init_process_group``.

    Args:
        model: the model, unwrapped, on the device it trains on.
        policy_arg: a `Policy`, a preset name, or a `Precision`.
        process_group: passed to DDP and used by the hook.
        **ddp_kwargs: passed to `DistributedDataParallel` (``device_ids``, ...).

    Raises:
        ValueError: `model` is already wrapped, or the policy sets ``output_dtype``
            (only FSDP2 casts outputs: use `shard`).
    """
    if process_group is None:
        require_process_group("mixprec.distributed.ddp")
    pol = policy_of(policy_arg)
    if pol.output_dtype is not None:
        raise ValueError(
            f"policy {pol.name!r} sets output_dtype, which only FSDP2 applies; use "
            "mixprec.distributed.shard(model, policy), or output_dtype=None"
        )
    set_storage(model, pol, wrapper="ddp")
    wrapped = torch.nn.parallel.DistributedDataParallel(
        model, process_group=process_group, **ddp_kwargs
    )
    wrapped.register_comm_hook(ReduceHookState(pol.reduce_dtype, process_group), reduce_in_dtype)
    mark_ddp_reduce_dtype(wrapped, pol.reduce_dtype)
    return wrapped
