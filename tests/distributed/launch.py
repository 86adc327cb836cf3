"""Run `worker.py`'s scenarios on 2 gloo ranks and collect each rank's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ranks import launch

WORKER = Path(__file__).with_name("worker.py")


def run_ranks(out: Path, *scenarios: str, world: int = 2, timeout: int = 300) -> list[Any]:
    """Run `scenarios` on `world` ranks; each rank's results (by scenario name)."""
    launch([str(WORKER), str(out), *scenarios], world=world, timeout=timeout)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
