"""Gradient-hook bookkeeping: accumulation that bypassed `Precision.backward`.

Under loss scaling, a plain ``loss.backward()`` among ``prec.backward(loss)``
calls accumulates unscaled parts into scaled gradients; unscaling them would
divide those parts by the loss scale. `AccumulationWatch` puts one
post-accumulate-grad hook on each parameter of a registered optimizer and notes
any accumulation that happens outside a scaled backward, so `step` can refuse it.

The hooks hold only a weak reference to the watch: they do nothing once the
`Precision` that owns it is gone.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

__all__ = ["AccumulationWatch"]


class AccumulationWatch:
    """Notes gradient accumulation outside a scaled backward (see the module docs)."""

    def __init__(self) -> None:
        self._in_scaled_backward = False
        self._unscaled_seen = False
        self._watched: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: tensors compare by value

    @property
    def unscaled_seen(self) -> bool:
        """Whether a gradient accumulated outside `scaled_backward` since `reset`."""
        return self._unscaled_seen

    def reset(self) -> None:
        """Forget accumulation seen so far (at the end of a step)."""
        self._unscaled_seen = False

    @contextlib.contextmanager
    def scaled_backward(self) -> Iterator[None]:
        """The backward run inside this context is the scaled one."""
        self._in_scaled_backward = True
        try:
            yield
        finally:
            self._in_scaled_backward = False

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Hook the gradient accumulation of `params` (each parameter once)."""
        ref = weakref.ref(self)

        def seen(_param: torch.Tensor) -> None:
            watch = ref()
            if watch is not None and not watch._in_scaled_backward:
                watch._unscaled_seen = True

        for p in params:
            known = self._watched.get(id(p))
            if p.requires_grad and (known is None or known() is not p):
                p.register_post_accumulate_grad_hook(seen)  # type: ignore[no-untyped-call]
                self._watched[id(p)] = weakref.ref(p)
