"""The exception and warning types mixprec raises.

`PrecisionError` is raised when training under a policy cannot go on safely
(for example a loss scale that keeps collapsing). `PrecisionWarning` marks a
configuration that runs but is known to lose accuracy silently (for example
AdamW moments stored in bf16). User mistakes in arguments raise the built-in
`ValueError` or `TypeError` with the bad value and the valid choices.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "PerformanceWarning",
    "PrecisionError",
    "PrecisionWarning",
    "UserCodeError",
    "user_stacklevel",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class PrecisionError(RuntimeError):
    """Training cannot continue safely under the current precision policy."""


class UserCodeError(RuntimeError):
    """An exception raised by the user's own code that mixprec called (a workload
    factory): the message names what was called and the original type and message."""


class PrecisionWarning(UserWarning):
    """A precision choice that runs but is known to degrade training quietly."""


class PerformanceWarning(UserWarning):
    """A precision choice that is correct but not accelerated on this device."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside mixprec.

    Call it from the function that warns: ``warnings.warn(..., stacklevel=
    user_stacklevel())``. Frames of mixprec's own files and generated code (a
    dataclass ``__init__``) are skipped, so the warning names the user's line
    whichever public entry point led there.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<") or os.path.abspath(name).startswith(_PACKAGE_DIR)):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
