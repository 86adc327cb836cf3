"""Run `worker.py`'s scenarios on 2 gloo ranks and collect each rank's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ranks import launch

WORKER = Path(__file__).with_name("worker.py")
#: `test_data_parallel`'s scenarios.
PARALLEL_SCENARIOS = (
    "fsdp_parity",
    "fsdp_parity_noclip",
    "ddp_parity",
    "ddp_default_fp32",
    "payload",
    "order",
    "skips",
    "load_mismatch",
)
#: `test_doctor_live`'s scenario.
DOCTOR_SCENARIO = "doctor"
#: Every scenario, in the order one launch runs them (the ``scenario_results`` fixture
#: in conftest.py: a launch costs each rank its torch import and a process group); the
#: refused load stays last.
SCENARIOS = (*PARALLEL_SCENARIOS[:-1], DOCTOR_SCENARIO, PARALLEL_SCENARIOS[-1])


def run_ranks(out: Path, *scenarios: str, world: int = 2, timeout: int = 300) -> list[Any]:
    """Run `scenarios` on `world` ranks; each rank's results (by scenario name)."""
    launch([str(WORKER), str(out), *scenarios], world=world, timeout=timeout)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def scenario_error(results: list[Any], names: tuple[str, ...]) -> str:
    """The first error a rank recorded for one of `names` (its traceback), or ``""``."""
    for rank in results:
        for name in names:
            value = rank[name]
            if isinstance(value, dict) and isinstance(value.get("error"), str):
                return f"scenario {name} raised on a rank:\n{value['error']}"
    return ""
