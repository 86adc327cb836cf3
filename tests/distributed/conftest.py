"""The distributed tests' shared launch of `worker.py`."""

from __future__ import annotations

from typing import Any

import pytest

from .launch import SCENARIOS, run_ranks


@pytest.fixture(scope="session")
def scenario_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of every `launch.SCENARIOS`, from one launch of 2 ranks; each
    test module fails on its own scenarios' errors."""
    return run_ranks(tmp_path_factory.mktemp("ranks"), *SCENARIOS)
