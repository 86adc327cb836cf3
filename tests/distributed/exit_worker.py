"""Ranks for `test_exit`, started by ``torch.multiprocessing.spawn``: docs/distributed.md's
"From Python" recipe on a tiny model, 2 steps (the parent sets ``MASTER_ADDR``,
``MASTER_PORT`` and ``WORLD_SIZE``; each rank sets its ``RANK``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.distributed import ddp, process_group, shard


def train(strategy: str) -> nn.Module:
    """Two steps of the recipe on a tiny model (also what bench/dist_exit.py trains)."""
    torch.manual_seed(0)
    prec = mixprec.Precision("bf16_master")
    model: nn.Module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model = ddp(model, prec) if strategy == "ddp" else shard(model, prec)
    model = prec.prepare(model)
    optimizer = prec.optimizer(model, lr=1e-3)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return model


def _join(rank: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def recipe(rank: int, strategy: str) -> None:
    """The recipe: the training runs in a function called within the block."""
    _join(rank)
    with process_group("cpu"):
        train(strategy)


def model_kept(rank: int, out: str) -> None:
    """The wrapped model is still alive when the block ends: writes the error."""
    _join(rank)
    model = None
    try:
        with process_group("cpu"):
            model = train("ddp")  # kept past the block
    except RuntimeError as exc:
        Path(out, f"rank{rank}.txt").write_text(f"{type(model).__name__}: {exc}")
    # `model` outlives the group: leaving through the interpreter's teardown is what
    # the error is about (it can hang), so this rank leaves at once.
    os._exit(0)
