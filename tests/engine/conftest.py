"""Shared engine fixtures."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from mixprec.errors import PerformanceWarning, PrecisionWarning


@pytest.fixture
def quiet_expected_warnings() -> Iterator[None]:
    # fp16 on this CPU is not accelerated and bf16_pure is risky: both warn by design,
    # and dedicated tests check those warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.simplefilter("ignore", PrecisionWarning)
        yield
