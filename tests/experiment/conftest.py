"""Shared experiment fixtures: one real run of every preset (runner and report tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.experiment import Contract, run_experiment
from mixprec.policy import PRESET_NAMES


@pytest.fixture(autouse=True)
def _cheap_plots(stand_in_plots: None) -> None:
    """Compares draw the report's plots by a stand-in, except in tests marked ``plots``
    (tests/experiment/report, where the plots are tested)."""


@pytest.fixture(scope="session")
def every_preset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Contract, list]:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("cmp")
    contract = Contract(
        workload="digits",
        size="tiny",
        baseline="fp32",
        candidates=tuple(p for p in PRESET_NAMES if p != "fp32"),
        seeds=1,
        max_seeds=1,
        # inf clips nothing, so bf16_lean4 (gradients released in backward) runs too
        train={"steps": 12, "grad_clip_norm": float("inf")},
        eval_every=6,
        probe_every=4,
        step_caps={},
    )
    _workload, records = run_experiment(contract, out, stream=None)
    return out, contract, records
