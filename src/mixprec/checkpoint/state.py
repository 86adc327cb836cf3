"""Live state in the form a checkpoint holds it, and back.

The optimizer's state dict is saved keyed by each parameter's name in the model
(not by its position), so a load can check it against the optimizer it goes into
and name what differs; the RNG states (torch CPU and CUDA, Python, NumPy) are
saved as tensors and plain lists, never pickled.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec.checkpoint.layout import CheckpointError

__all__ = [
    "indexed_optimizer_state",
    "named_optimizer_state",
    "param_names",
    "rng_state",
    "set_rng_state",
]


def param_names(model: nn.Module | None) -> dict[torch.Tensor, str]:
    """Each parameter of `model` by its first name (a tied weight has several)."""
    if model is None:
        return {}
    names: dict[torch.Tensor, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_keys(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> list[str]:
    """The key each optimizer parameter is saved under: its name in the model."""
    keys = []
    for i, p in enumerate(_optimizer_params(optimizer)):
        name = names.get(p)
        if name is None:
            raise CheckpointError(
                f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                "model: pass the model the optimizer trains"
            )
        keys.append(name)
    if len(set(keys)) != len(keys):
        raise CheckpointError("the optimizer holds one parameter twice: its state is ambiguous")
    return keys


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """The optimizer's state dict with parameter names for its integer ids."""
    keys = _param_keys(optimizer, names)
    sd = optimizer.state_dict()
    ids = [pid for group in sd["param_groups"] for pid in group["params"]]
    key_of = dict(zip(ids, keys, strict=True))
    return {
        "state": {key_of[pid]: value for pid, value in sd["state"].items()},
        "param_groups": [
            {**g, "params": [key_of[pid] for pid in g["params"]]} for g in sd["param_groups"]
        ],
    }


def indexed_optimizer_state(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """`named_optimizer_state` output as `optimizer.load_state_dict` takes it."""
    keys = _param_keys(optimizer, names)
    index = {key: i for i, key in enumerate(keys)}
    groups = saved.get("param_groups")
    state = saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CheckpointError("the saved optimizer state is malformed")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer as the run did"
        )
    out_groups = []
    for i, (group, mine) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        saved_keys = list(group.get("params", []))
        my_keys = [keys[index[names[p]]] for p in mine["params"]]
        if saved_keys != my_keys:
            missing = sorted(set(my_keys) - set(saved_keys))[:3]
            extra = sorted(set(saved_keys) - set(my_keys))[:3]
            raise CheckpointError(
                f"param group {i} of the checkpoint holds other parameters (missing here: "
                f"{extra}, not saved: {missing}): build the optimizer as the run did"
            )
        out_groups.append({**group, "params": [index[k] for k in saved_keys]})
    unknown = sorted(set(state) - set(index))[:3]
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds optimizer state for unknown parameters {unknown}"
        )
    return {"state": {index[k]: v for k, v in state.items()}, "param_groups": out_groups}


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA, when initialised), Python, NumPy."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA only onto as many devices as saved)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
