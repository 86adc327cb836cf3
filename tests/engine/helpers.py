"""Shared engine test helpers: a small model with a LayerNorm, data, a training loop."""

from __future__ import annotations

import math

import torch
from torch import nn

import mixprec
from mixprec import Precision

__all__ = ["grad_step", "loss_fn", "make_data", "make_model", "train"]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 4),
    )


def make_data(n: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    return x, y


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def train(prec: Precision, steps: int, lr: float = 1e-2) -> list[float]:
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=lr, weight_decay=0.0)
    x, y = make_data()
    losses = []
    for i in range(steps):
        xb, yb = x[(i * 32) % 256 :][:32], y[(i * 32) % 256 :][:32]
        with prec.autocast():
            loss = loss_fn(model(xb), yb)
        prec.backward(loss)
        if not prec.plan.release_gradients:  # (each parameter was stepped in backward)
            prec.clip_grad_norm_(model.parameters(), 5.0)
        report = prec.step(opt)
        assert report.applied
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def grad_step(
    prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, inject: bool
) -> mixprec.StepReport:
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    prec.backward(loss)
    if inject:
        model[3].weight.grad[0, 0] = math.inf
    report = prec.step(opt)
    opt.zero_grad(set_to_none=True)
    return report
