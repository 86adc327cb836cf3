"""Shared test setup: a fixed, small thread count (2 cores here; oversubscription makes
small steps many times slower) and deterministic seeds."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one state per process (``AcceleratorState``: mixed precision,
    device, accumulation), and a second ``Accelerator`` with other settings raises; each
    test that builds one (directly, or through the HF Trainer) starts from none."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
