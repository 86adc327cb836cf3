"""Parameters sharded as `DTensor` (FSDP2): state sharded with them, steps on local shards.

`AdamW` allocates the state of a DTensor parameter from its local shard and
wraps every state tensor (remainders, compensation, fp32 master, moments, int8
codes and scales) as a DTensor on the parameter's mesh with its placements and
with the global shape an unsharded parameter's state has, so ``state_dict()``
holds DTensors that `torch.distributed.checkpoint` saves and reshards like the
parameters. A step runs the kernel on each rank's local tensors (every format
is elementwise or per block) and draws stochastic-rounding noise by global
element position, so a sharded run equals an unsharded one bitwise.

int8 blocks run along the flattened parameter. Per-row scales (rows made of
whole blocks) always shard with the rows; flat scales need every shard
boundary on a block boundary (`int8_blocks_fit`). A parameter whose blocks
would straddle shards keeps fp32 moments, and only sharding on dim 0 (FSDP2's
layout) is supported for int8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "column_group",
    "column_stats_fit",
    "dim0_row_counts",
    "dim0_rows",
    "global_flat_offset",
    "int8_blocks_fit",
    "int8_shards_fit",
    "is_dtensor",
    "local",
    "max_over",
    "replicate_like",
    "shard_like",
    "write_version",
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


def write_version(t: torch.Tensor) -> int:
    """The version counter of the storage `t`'s values live in: it moves on every
    in-place write (a model load, an init, ``mul_``), and not when the optimizer writes
    through a detached view. A DTensor's own local tensor is read (``detach`` and
    ``to_local`` make views with counters of their own)."""
    inner = getattr(t, "_local_tensor", None) if is_dtensor(t) else None
    return int((inner if isinstance(inner, torch.Tensor) else t)._version)


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


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    # (start, size) of each part of `n` rows under torch.chunk, as DTensor's Shard does.
    step = -(-n // parts) if n else 0
    return [(min(i * step, n), max(0, min(step, n - i * step))) for i in range(parts)]


def dim0_rows(rows: int, parts: int) -> list[int]:
    """Rows each of `parts` ranks holds when dim 0 of `rows` rows is sharded as DTensor's
    ``Shard(0)`` and FSDP2 do (``torch.chunk``: ``ceil(rows / parts)`` rows on the first
    ranks, fewer or none on the last). Rank 0 always holds the most."""
    return [size for _, size in _chunks(rows, parts)]


def dim0_row_counts(rows: int, parts: int) -> dict[int, int]:
    """`dim0_rows` as {rows held: ranks holding that many}, in time independent of
    `parts`: ``ceil(rows / parts)`` rows on the first ranks, the rest on one, none on
    the others."""
    step = -(-rows // parts) if rows else 0
    full, rest = divmod(rows, step) if step else (0, 0)
    counts = {step: full} if full else {}
    if rest:
        counts[rest] = 1
    empty = parts - full - (1 if rest else 0)
    if empty:
        counts[0] = counts.get(0, 0) + empty
    return counts


def int8_shards_fit(
    shape: tuple[int, ...], block_size: int, scale_shape: tuple[int, ...], parts: int
) -> bool:
    """Whether every one of `parts` dim-0 shards of a tensor of `shape` holds whole
    int8 blocks (`int8_blocks_fit` for a DTensor sharded on dim 0 over one mesh dim).

    Rank i's rows start at element ``min(i ceil(rows / parts), rows) * row`` and its
    blocks at ``min(i ceil(blocks / parts), blocks) * block_size``: two lines that
    level off at the tensor's end. They agree at every rank (in time independent of
    `parts`) when they cover the same elements and rise equally, or when both reach
    the end at the first rank already.
    """
    if len(scale_shape) == 2 or parts == 1 or not shape:
        return True
    numel = 1
    for size in shape:
        numel *= size
    row = numel // shape[0] if shape[0] else 0
    rows, blocks = shape[0], scale_shape[0]
    if rows * row != blocks * block_size:
        return False
    rows_per_rank = -(-rows // parts) * row
    blocks_per_rank = -(-blocks // parts) * block_size
    end = rows * row
    return rows_per_rank == blocks_per_rank or min(rows_per_rank, blocks_per_rank) >= end


def int8_blocks_fit(param: torch.Tensor, block_size: int, scale_shape: tuple[int, ...]) -> bool:
    """Whether every shard of DTensor `param` holds whole int8 blocks (true for plain params).

    The scales (`Int8Moments.scale_shape`) are sharded like the parameter. Per-row
    scales ``(rows, k)`` always split with the rows. Flat scales ``(blocks,)`` do
    when, on every rank, the parameter's rows and the scales' blocks cover the
    same elements (one mesh dim sharding dim 0); otherwise int8 moments do not
    fit this sharding and the parameter keeps fp32 moments.
    """
    if not is_dtensor(param):
        return True
    if not _dim0_only(param):
        return False
    if len(scale_shape) == 2:
        return True
    mesh = param.device_mesh  # type: ignore[attr-defined]
    sharded = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]  # type: ignore[attr-defined]
    if not sharded:
        return True
    if len(sharded) > 1:
        return False
    return int8_shards_fit(tuple(param.shape), block_size, scale_shape, mesh.size(sharded[0]))


def _split_dims(t: torch.Tensor) -> list[int]:
    """The mesh dims over which DTensor `t` is split (Shard placements over more than
    one rank)."""
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return [
        i
        for i, p in enumerate(t.placements)  # type: ignore[attr-defined]
        if isinstance(p, Shard) and mesh.size(i) > 1
    ]


def column_group(t: torch.Tensor) -> Any:
    """The process group over whose ranks DTensor `t`'s dim 0 is split (the group a
    statistic spanning every row is reduced over), or None when no rank holds fewer
    rows than the whole: plain, replicated, or not split on dim 0 alone over one mesh
    dim (callers keep such tensors off formats with column statistics)."""
    if not is_dtensor(t):
        return None
    split = _split_dims(t)
    return t.device_mesh.get_group(split[0]) if split else None  # type: ignore[attr-defined]


def column_stats_fit(t: torch.Tensor) -> bool:
    """Whether `t` can keep column statistics reduced over `column_group`: plain, or a
    DTensor split on dim 0 over at most one mesh dim."""
    if not is_dtensor(t):
        return True
    return _dim0_only(t) and len(_split_dims(t)) <= 1


def max_over(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise maximum over the ranks of process group `group`, in place
    (exact in any order: what `column_group`'s statistics are reduced with)."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    return reduce


def replicate_like(state: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap a state tensor every rank of DTensor `param` holds whole (column statistics,
    equal on every rank) as a replicated DTensor on the parameter's mesh."""
    if not is_dtensor(param):
        return state
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return DTensor.from_local(state, mesh, [Replicate()] * mesh.ndim, run_check=False)


def shard_like(state: torch.Tensor, param: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Wrap a local state tensor of DTensor `param` as a DTensor of global `shape`
    sharded like the parameter (0-d state and state of plain params stay as they are).

    `shape` is the state's shape for the whole parameter (what the format
    allocates for an unsharded one).
    """
    if not is_dtensor(param) or state.dim() == 0:
        return state
    return DTensor.from_local(
        state,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )
