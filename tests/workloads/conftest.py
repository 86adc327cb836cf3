"""Shared helpers for the workload tests: a plain fp32 AdamW training loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec.workloads import Workload

TrainFn = Callable[..., nn.Module]


def train_fp32(workload: Workload, *, steps: int, seed: int = 0) -> nn.Module:
    """Train a fresh model of `workload` for `steps` AdamW steps in fp32 at its default lr."""
    defaults = workload.defaults
    model = workload.make_model(seed)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=defaults.lr, weight_decay=defaults.weight_decay
    )
    for step in range(steps):
        inputs, targets = workload.train_batch(
            step=step, seed=seed, batch_size=defaults.batch_size, device="cpu"
        )
        loss = workload.loss(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.fixture
def train() -> TrainFn:
    """The fp32 training loop, as a fixture."""
    return train_fp32
