"""A user workload built from plain callables, loaded by `test_workload_registry`.

This is the pattern `docs/workloads.md` describes: a function returning a
`Workload`, named on the command line as `example_user_workload:make_workload`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.workloads import (
    AutocastFactory,
    EvalResult,
    TrainSettings,
    Workload,
    batch_generator,
    evaluation_mode,
    model_device,
    seeded_init,
)

__all__ = ["NOT_A_FUNCTION", "make_workload", "not_a_workload"]

NOT_A_FUNCTION = 3


def make_workload(*, n_features: int = 8, noise: float = 0.1, dropout: float = 0.0) -> Workload:
    """Linear regression with a fixed true weight (its inputs dropped out with
    probability `dropout` in training); metric: held-out R^2."""
    true_w = torch.randn(n_features, 1, generator=torch.Generator().manual_seed(1234))

    def sample(generator: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, n_features, generator=generator)
        return x, x @ true_w + noise * torch.randn(n, 1, generator=generator)

    held_x, held_y = sample(torch.Generator().manual_seed(99), 256)

    def make_model(seed: int) -> nn.Module:
        if dropout:
            return seeded_init(
                seed, lambda: nn.Sequential(nn.Dropout(dropout), nn.Linear(n_features, 1))
            )
        return seeded_init(seed, lambda: nn.Linear(n_features, 1))

    def train_batch(
        *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        x, y = sample(batch_generator(seed, step, stream="example"), batch_size)
        return x.to(device), y.to(device)

    def loss(output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output.float(), target)

    def evaluate(model: nn.Module, *, autocast: AutocastFactory) -> EvalResult:
        with evaluation_mode(model):
            with autocast():
                pred = model(held_x.to(model_device(model)))
            mse = float(loss(pred.cpu(), held_y))
        r2 = 1.0 - mse / float(held_y.var(unbiased=False))
        return EvalResult(loss=mse, metric=r2, metric_name="r2", num_targets=held_y.numel())

    return Workload(
        name="linreg",
        description=f"linear regression, {n_features} features",
        metric_name="r2",
        higher_is_better=True,
        defaults=TrainSettings(
            steps=100,
            batch_size=32,
            lr=0.05,
            min_lr=0.0,
            warmup_steps=0,
            weight_decay=0.0,
            grad_clip_norm=None,
        ),
        make_model=make_model,
        train_batch=train_batch,
        loss=loss,
        evaluate=evaluate,
        config={"n_features": n_features, "noise": noise},
    )


def not_a_workload() -> str:
    """A factory that returns the wrong type."""
    return "not a workload"
