"""A user workload module whose own import fails (its dependency is missing)."""

from __future__ import annotations

import mixprec_test_dependency_that_does_not_exist  # type: ignore[import-not-found]  # noqa: F401

__all__: list[str] = []
