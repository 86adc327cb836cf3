"""A Ctrl-C held over writes that must happen together.

`held()` holds a SIGINT that arrives within its block and raises it as
`KeyboardInterrupt` once the block is done. The optimizer holds it from its native
call until it has recorded the write as its own (`mixprec.optim.AdamW.step`), and
`Precision.step` while a step's optimizers apply, so that they apply all or none.
Only in the main thread (where Python delivers signals) and only where Python's own
SIGINT handler is installed: a program's own handler (the CLI's cooperative one, a
notebook kernel's) is left alone.

It runs on every optimizer step, so it calls `_signal` (the C module `signal`
re-exports): `signal.signal` and `signal.getsignal` convert handlers to enums,
which costs about 3 us a call (measured on CPython 3.11), against 0.4 us.
"""

from __future__ import annotations

import importlib
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

_c_signal: Any
try:
    _c_signal = importlib.import_module("_signal")
except ImportError:  # pragma: no cover - an interpreter without CPython's C module
    _c_signal = signal

__all__ = ["held"]

_SIGINT = int(signal.SIGINT)
_MAIN = threading.main_thread()


class held:  # noqa: N801 - used as a function: ``with ctrl_c.held():``
    """Hold a Ctrl-C (SIGINT) within the block; raise `KeyboardInterrupt` after it."""

    __slots__ = ("_handler", "_previous", "_received")

    def __init__(self) -> None:
        self._previous: object = None
        self._received = False
        self._handler = self._hold  # one bound method: compared by identity on exit

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self._received = True

    def __enter__(self) -> None:
        if (
            threading.current_thread() is _MAIN
            and _c_signal.getsignal(_SIGINT) is signal.default_int_handler
        ):
            self._previous = _c_signal.signal(_SIGINT, self._handler)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is None:
            return
        if _c_signal.getsignal(_SIGINT) is self._handler:
            # (a handler the program installed within the block stays)
            _c_signal.signal(_SIGINT, self._previous)
        self._previous = None
        if self._received:
            # Also when the block raised: the Ctrl-C is not lost, the error is its context.
            self._received = False
            raise KeyboardInterrupt
