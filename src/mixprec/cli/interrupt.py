"""Cooperative Ctrl-C (and SIGTERM): the first one asks long commands to stop at a safe point."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["INTERRUPTED", "TERMINATED", "cooperative_sigint", "cooperative_sigterm"]

#: Set by the first Ctrl-C; long commands stop at their next safe point.
INTERRUPTED = threading.Event()

#: Set by the first SIGTERM within `cooperative_sigterm` (`mixprec train`: a cluster's
#: "stop now"); the command stops at its next safe point, as for Ctrl-C.
TERMINATED = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    # An asynchronous KeyboardInterrupt can land inside an import (numpy then recursed
    # without end on its next import) or in a Python callback of torch's C++ code
    # (pybind11 aborts the process). The first Ctrl-C only sets a flag that compare
    # checks before each training step; a second one interrupts at once.
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    INTERRUPTED.set()


@contextlib.contextmanager
def _handled(signum: int, flag: threading.Event, handler: Any) -> Iterator[None]:
    """Within the block, `handler` answers `signum` (clearing `flag` first); in the
    main thread only, where Python delivers signals."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    flag.clear()
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def cooperative_sigint() -> contextlib.AbstractContextManager[None]:
    """Within the block, Ctrl-C sets `INTERRUPTED`; a second Ctrl-C interrupts at once."""
    import signal

    return _handled(signal.SIGINT, INTERRUPTED, _on_sigint)


def _on_sigterm(signum: int, frame: Any) -> None:
    import os
    import signal

    if TERMINATED.is_set():  # a second SIGTERM: terminate at once, as without the handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    TERMINATED.set()


def cooperative_sigterm() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM sets `TERMINATED`; a second SIGTERM terminates at once."""
    import signal

    return _handled(signal.SIGTERM, TERMINATED, _on_sigterm)
