"""The collective side of a checkpoint: which rank does what, and agreeing on failure.

With a process group (``torch.distributed`` initialised), `save` and `load` are
collective: every rank calls them. DCP writes and reads each rank's shards; rank 0
alone verifies, writes the manifest, renames and moves ``latest``. Before each step
that only succeeds if every rank's part did, the ranks exchange their errors
(`agree`, or `together` around a part that may fail), so all of them raise the
same error together instead of some waiting forever in the next collective.
Without a process group every function here is a no-op for one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec.checkpoint.layout import CheckpointError
from mixprec.distributed.launch import rank, world_size

__all__ = [
    "agree",
    "broadcast",
    "gather",
    "is_collective",
    "owned",
    "rank",
    "shard_like",
    "together",
    "unwrap",
    "world_size",
]


def is_collective() -> bool:
    """Whether a process group is initialised (`save` and `load` are then collective)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agree(error: str | None) -> str | None:
    """Every rank's error (None: this rank's part succeeded), exchanged.

    Returns:
        The error of the lowest failing rank, the same text on every rank, or None
        when every rank succeeded.
    """
    if not is_collective():
        return error
    errors: list[str | None] = [None] * world_size()
    torch.distributed.all_gather_object(errors, error)
    for r, found in enumerate(errors):
        if found is not None:
            return found if r == 0 else f"rank {r}: {found}"
    return None


_T = TypeVar("_T")


def together(part: Callable[[], _T]) -> _T:
    """Run this rank's `part`; with a process group, every rank then raises the
    lowest failing rank's error, or all go on (no rank is left waiting in the next
    collective). Without one, errors propagate unchanged."""
    if not is_collective():
        return part()
    error, result = None, None
    try:
        result = part()
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    message = agree(error)
    if message is not None:
        raise CheckpointError(message)
    return result  # type: ignore[return-value]


def broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (picklable values only)."""
    if not is_collective():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    if not is_collective():
        return [value]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The module a `DistributedDataParallel` wraps (its keys without ``module.``), or
    `model` itself: DDP and single-process checkpoints share their keys. FSDP2's
    ``fully_shard`` keeps the model's own names, so it needs no unwrapping."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner
    return model


def shard_like(
    size: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor | None
) -> torch.Tensor:
    """An empty tensor to read a saved tensor of global `size` into.

    A DTensor sharded like `like` (DCP then reads only this rank's shard, from
    however many files the saving ranks wrote), when `like` is a DTensor whose
    placements fit `size`; a plain tensor of the whole `size` otherwise.
    """
    from mixprec.optim.sharding import is_dtensor

    if like is None or not is_dtensor(like) or not size:
        return torch.empty(size, dtype=dtype)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    placements = like.placements  # type: ignore[attr-defined]
    fits = all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < len(size)) for p in placements
    )
    if not fits:
        return torch.empty(size, dtype=dtype)
    return dtensor_empty(
        size,
        dtype=dtype,
        device_mesh=like.device_mesh,  # type: ignore[attr-defined]
        placements=placements,
    )


def owned(
    tensors: Mapping[str, torch.Tensor], own: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """The tensors this rank gives DCP to write: every DTensor (each rank writes its
    shards), rank 0's plain tensors (replicated state is saved once, from rank 0),
    and the keys in `own` (this rank's RNG states)."""
    from mixprec.optim.sharding import is_dtensor

    first = rank() == 0
    return {k: t for k, t in tensors.items() if first or k in own or is_dtensor(t)}
