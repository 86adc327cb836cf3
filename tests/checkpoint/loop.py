"""A small training run shared by the checkpoint tests and their child processes.

The child processes import this file by path (``python tests/checkpoint/child.py``),
so it depends on nothing but mixprec and torch.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import mixprec
from mixprec import checkpoint

#: Every preset, each with int8 moments, remainders and scales large enough to be used.
PRESETS = mixprec.policy.PRESET_NAMES


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 256), nn.LayerNorm(256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 8)
    )


def build(policy: str) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.Precision]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mixprec.Precision(policy)
        model = prec.prepare(make_model())
        optimizer = prec.optimizer(model, lr=3e-3, weight_decay=0.1)
    return model, optimizer, prec


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, 16, generator=g), torch.randint(0, 8, (64,), generator=g)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    prec: mixprec.Precision,
    start: int,
    stop: int,
) -> list[float]:
    """Steps `start..stop-1`; dropout and a Python/NumPy draw use the global RNGs."""
    losses = []
    model.train()
    for step in range(start, stop):
        x, y = batch(step)
        x = x * (1 + 0.01 * random.random()) * float(1 + 0.01 * np.random.rand())
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        if not prec.plan.release_gradients:  # (stepped in backward: nothing to clip)
            prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, their masters (mixprec AdamW) and every optimizer state tensor."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    masters = getattr(optimizer, "master_weights", None)
    if masters is not None:
        for (n, _), m in zip(model.named_parameters(), masters(), strict=True):
            out[f"master/{n}"] = m
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            out[f"state/{names[p]}/{key}"] = value.detach().clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, for bitwise comparison of any dtype."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def run_then_save(policy: str, root: Path, steps: int) -> list[float]:
    seed_everything()
    model, optimizer, prec = build(policy)
    losses = train(model, optimizer, prec, 0, steps)
    checkpoint.save(root, model=model, optimizer=optimizer, precision=prec, step=steps)
    return losses


def load_then_run(policy: str, root: Path, steps: int) -> tuple[list[float], dict[str, Any]]:
    seed_everything(7)  # a different state: the checkpoint must restore it
    model, optimizer, prec = build(policy)
    start = checkpoint.load(root, model=model, optimizer=optimizer, precision=prec)["step"]
    losses = train(model, optimizer, prec, start, steps)
    return losses, snapshot(model, optimizer)


def seed_everything(seed: int = 0) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
