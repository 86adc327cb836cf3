"""The exception and warning types mixprec raises.

`PrecisionError` is raised when training under a policy cannot go on safely
(for example a loss scale that keeps collapsing). `PrecisionWarning` marks a
configuration that runs but is known to lose accuracy silently (for example
AdamW moments stored in bf16). User mistakes in arguments raise the built-in
`ValueError` or `TypeError` with the bad value and the valid choices.
"""

from __future__ import annotations

__all__ = ["PerformanceWarning", "PrecisionError", "PrecisionWarning"]


class PrecisionError(RuntimeError):
    """Training cannot continue safely under the current precision policy."""


class PrecisionWarning(UserWarning):
    """A precision choice that runs but is known to degrade training quietly."""


class PerformanceWarning(UserWarning):
    """A precision choice that is correct but not accelerated on this device."""
