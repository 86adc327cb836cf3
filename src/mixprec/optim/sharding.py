"""Parameters sharded as `DTensor` (FSDP2): state sharded with them, steps on local shards.

`AdamW` allocates the state of a DTensor parameter from its local shard and
wraps every element-shaped state tensor (remainders, compensation, fp32
master, moments, int8 codes) as a DTensor with the parameter's mesh and
placements, so ``state_dict()`` holds DTensors that
`torch.distributed.checkpoint` saves and reshards like the parameters. The
int8 per-block scales are shaped ``(rows, row_numel // block)`` and sharded
the same way, which needs whole blocks per row and sharding on dim 0 only
(FSDP2's layout); other params keep fp32 moments. A step runs the kernel on
each rank's local tensors (every format is elementwise or per block), and the
stochastic-rounding noise is indexed by global element position, so a sharded
run equals an unsharded one bitwise.
"""

from __future__ import annotations

import torch

__all__ = [
    "global_flat_offset",
    "int8_blocks_fit",
    "is_dtensor",
    "local",
    "shard_like",
]

try:  # torch >= 2.4 public API
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a `DTensor` (a sharded or replicated distributed tensor)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing its storage), or `t` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _dim0_only(t: torch.Tensor) -> bool:
    return all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
        for p in t.placements  # type: ignore[attr-defined]
    )


def global_flat_offset(t: torch.Tensor) -> int | None:
    """Position of the local shard's first element in the global row-major order.

    0 for plain tensors; for a DTensor sharded on dim 0 only (or replicated),
    the local shard is one contiguous run of the global tensor and this is
    where it starts. None for other placements (no such single offset).
    """
    if not is_dtensor(t):
        return 0
    if not _dim0_only(t):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(
        t.shape,
        t.device_mesh,  # type: ignore[attr-defined]
        t.placements,  # type: ignore[attr-defined]
    )
    row = 1
    for size in t.shape[1:]:
        row *= size
    return int(offsets[0]) * row if offsets else 0


def int8_blocks_fit(param: torch.Tensor, block_size: int) -> bool:
    """Whether a DTensor param's shards hold whole int8 blocks (always true for plain params).

    Needs sharding on dim 0 only and rows made of whole blocks, so every
    shard is a run of complete rows and the scales shard along with them.
    """
    if not is_dtensor(param):
        return True
    row = 1
    for size in param.shape[1:]:
        row *= size
    return param.dim() >= 2 and row % block_size == 0 and _dim0_only(param)


def shard_like(state: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap a local state tensor of DTensor `param` as a DTensor sharded like it.

    Element-shaped state takes the parameter's global shape; per-row state
    (int8 scales, local shape ``(local_rows, k)``) takes ``(rows, k)``.
    0-d state (step counts, seeds) stays a plain tensor.
    """
    if not is_dtensor(param) or state.dim() == 0:
        return state
    local_param = local(param)
    if state.shape == local_param.shape:
        shape, stride = param.shape, param.stride()
    else:
        shape = torch.Size((param.shape[0], *state.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        state,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=shape,
        stride=stride,
    )
