"""Cooperative Ctrl-C: the first one asks long commands to stop at a safe point."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["INTERRUPTED", "cooperative_sigint"]

#: Set by the first Ctrl-C; long commands stop at their next safe point.
INTERRUPTED = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    # An asynchronous KeyboardInterrupt can land inside an import (numpy then recursed
    # without end on its next import) or in a Python callback of torch's C++ code
    # (pybind11 aborts the process). The first Ctrl-C only sets a flag that compare
    # checks before each training step; a second one interrupts at once.
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    INTERRUPTED.set()


@contextlib.contextmanager
def cooperative_sigint() -> Iterator[None]:
    """Within the block, Ctrl-C sets `INTERRUPTED`; a second Ctrl-C interrupts at once."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    INTERRUPTED.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
