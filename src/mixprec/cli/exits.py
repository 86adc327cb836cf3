"""The one mapping from outcomes and errors to exit codes and one-line messages.

Exit codes: 0 success; 1 a check found errors (doctor) or nothing could be
recommended (compare); 2 bad input or any other error, with one line on
stderr; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM, where a command stops
cleanly on it: `mixprec train`).
"""

from __future__ import annotations

from mixprec.cli.common import UsageError

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILED_CHECK",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "error_line",
    "first_line",
]

EXIT_OK = 0
EXIT_FAILED_CHECK = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process it terminated

#: Errors whose message is for the user as it stands (no type name, no hint).
_USER_ERRORS = (UsageError, ValueError, TypeError, OSError, ImportError, LookupError)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def error_line(exc: BaseException, *, prog: str = "mixprec", debug: bool = False) -> str:
    """The one line printed for an error that ends a command with `EXIT_BAD_INPUT`."""
    if isinstance(exc, UsageError):
        return first_line(exc)
    if isinstance(exc, _USER_ERRORS):
        return f"{prog}: error: {first_line(exc)}"
    hint = "" if debug else " (rerun with --traceback or MIXPREC_DEBUG=1 for details)"
    return f"{prog}: error: {type(exc).__name__}: {first_line(exc)}{hint}"
