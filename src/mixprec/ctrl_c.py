"""A Ctrl-C held over writes that must happen together.

`held()` holds a SIGINT that arrives within its block and raises it as
`KeyboardInterrupt` once the block is done. The optimizer holds it from its native
call until it has recorded the write as its own (`mixprec.optim.AdamW.step`), and
`Precision.step` while a step's optimizers apply, so that they apply all or none.
Only in the main thread (where Python delivers signals) and only where Python's own
SIGINT handler is installed: a program's own handler (the CLI's cooperative one, a
notebook kernel's) is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["held"]


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) within the block; raise `KeyboardInterrupt` after it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
