"""Transient memory measured inside windows of a real step: what an op sequence allocates
and frees again before the window closes.

`LiveBytes` is a `TorchDispatchMode` that records, in order, every plain tensor storage an
op allocates while it is on and the moment that storage is freed (a `weakref.finalize` on
the storage). Wrapper tensor subclasses (torchao's ``Float8TrainingTensor``) are handed
back to their own ``__torch_dispatch__`` (the mode answers ``NotImplemented``), so the
plain tensors they allocate inside (an emulated GEMM's dequantized copies) are recorded
too. A window is opened and closed by hooks (`open`, `close`); `transient_peak` replays
its events: the largest sum of bytes allocated inside the window and still live, leaving
out what survives the window (its outputs). This is the measured witness of the FP8
casts' temporaries (`mixprec.memory.fp8`); it counts tensor storages, not the allocator's
rounding or a kernel's workspace.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "Window"]


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass
class Window:
    """The events of one window, in order: ``(allocation id, +bytes)`` when a storage is
    allocated and ``(allocation id, -bytes)`` when it is freed, from `LiveBytes.open` to
    `close` (frees after the close are recorded too: they tell what survived)."""

    label: str
    events: list[tuple[int, int]] = field(default_factory=list)
    closed_at: int | None = None  # len(events) when the window closed

    def transient_peak(self) -> int:
        """The most bytes allocated inside the window and live at once, outputs (storages
        still live when the window closed) left out."""
        end = self.closed_at if self.closed_at is not None else len(self.events)
        inside = self.events[:end]
        freed = {i for i, b in inside if b < 0}
        live = peak = 0
        for i, b in inside:
            if i in freed:
                live += b
                peak = max(peak, live)
        return peak


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record the storages ops allocate, and their frees, into the open window.

    Enter the mode only while a window is open (`open` enters it, `close` leaves it),
    so the rest of the step runs without it. Windows do not nest.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.windows: list[Window] = []
        self._open: Window | None = None
        self._live: set[int] = set()  # storage keys recorded in the open window and live
        self._ids = 0

    def open(self, label: str) -> None:
        """Open a window named `label` and start recording."""
        if self._open is not None:  # a window left open by an exception: close it
            self.close()
        self._open = Window(label)
        self._live = set()
        self.windows.append(self._open)
        self.__enter__()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Close the open window (if any) and stop recording."""
        window = self._open
        if window is None:
            return
        window.closed_at = len(window.events)
        self._open = None
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def _freed(self, window: Window, live: set[int], key: int, ident: int, nbytes: int) -> None:
        live.discard(key)
        window.events.append((ident, -nbytes))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            return NotImplemented  # a wrapper subclass: its own plain ops come back here
        out = func(*args, **(kwargs or {}))
        window = self._open
        if window is None:
            return out
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if _plain(t)}
        for t in tree_flatten(out)[0]:
            if not _plain(t):
                continue
            key = _key(t)
            nbytes = t.untyped_storage().nbytes()
            if key in inputs or key in self._live or nbytes == 0:
                continue  # a view, an in-place result, or seen already
            self._ids += 1
            self._live.add(key)
            window.events.append((self._ids, nbytes))
            weakref.finalize(
                t.untyped_storage(), self._freed, window, self._live, key, self._ids, nbytes
            )
        return out
