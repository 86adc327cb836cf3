"""The report tests' shared judged experiment (constructed records, see `judged.py`)."""

from __future__ import annotations

import pytest

from .judged import Judged, make_judged


@pytest.fixture(scope="session")
def judged() -> Judged:
    return make_judged()
