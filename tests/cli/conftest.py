"""The CLI tests' shared setup: compare's report plots drawn by a stand-in."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _cheap_plots(stand_in_plots: None) -> None:
    """No CLI test checks the pixels of a plot (tests/experiment/report does)."""
