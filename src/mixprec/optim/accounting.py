"""Exact memory accounting of optimizer state, by category, over unique storages."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "MASTER_STATE_KEYS",
    "MOMENT_STATE_KEYS",
    "optimizer_state_bytes",
    "training_state_bytes",
]

#: State keys holding master-weight information (any optimizer in mixprec).
MASTER_STATE_KEYS: frozenset[str] = frozenset(
    {"master", "remainder", "remainder_hi", "remainder_lo", "compensation"}
)

#: State keys holding moments (mixprec formats and torch's own names).
MOMENT_STATE_KEYS: frozenset[str] = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_avg_i8",
        "exp_avg_absmax",
        "exp_avg_sq_u8",
        "exp_avg_sq_absmax",
    }
)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor shards count their local part
    return to_local() if callable(to_local) else t


def _storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    # Wrapper subclasses (torchao's quantized optimizer states) have no storage
    # of their own: count the plain tensors they are made of.
    flatten = getattr(t, "__tensor_flatten__", None)
    if not callable(flatten):
        return [t]
    names, _ = flatten()
    return [inner for name in names for inner in _storage_tensors(getattr(t, name))]


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes_of(self, tensors: Iterable[object]) -> int:
        total = 0
        for obj in tensors:
            if not isinstance(obj, torch.Tensor):
                continue
            for t in _storage_tensors(_local(obj)):
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if key in self.seen or storage.nbytes() == 0:
                    continue
                self.seen.add(key)
                total += storage.nbytes()
        return total


def _category(key: str) -> str:
    if key in MASTER_STATE_KEYS:
        return "master"
    if key in MOMENT_STATE_KEYS:
        return "moments"
    return "other"


def _state_bytes(optimizer: torch.optim.Optimizer, counter: _Counter) -> dict[str, int]:
    out = {"master": 0, "moments": 0, "other": 0}
    for state in optimizer.state.values():
        for key, value in state.items():
            out[_category(key)] += counter.bytes_of([value])
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of optimizer state by category, each storage counted once.

    Works for any `torch.optim.Optimizer` (unknown state keys count as "other").

    Returns:
        ``{"master": ..., "moments": ..., "other": ..., "total": ...}``.
    """
    out = _state_bytes(optimizer, _Counter())
    out["total"] = sum(out.values())
    return out


def training_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Persistent bytes of params, grads and optimizer state, each storage counted once.

    Returns:
        ``{"params", "grads", "master", "moments", "other", "total"}`` in bytes.
    """
    counter = _Counter()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {
        "params": counter.bytes_of(params),
        "grads": counter.bytes_of(p.grad for p in params if p.grad is not None),
    }
    out.update(_state_bytes(optimizer, counter))
    out["total"] = sum(out.values())
    return out
