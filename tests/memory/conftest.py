"""Memory tests build models under every preset: precision and performance warnings
about the presets themselves are not what these tests check."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from mixprec.errors import PerformanceWarning, PrecisionWarning


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        warnings.simplefilter("ignore", PerformanceWarning)
        yield
